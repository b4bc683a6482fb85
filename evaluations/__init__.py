"""Benchmarks and measurements: each module is a script that prints a table."""
