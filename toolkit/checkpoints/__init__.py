"""Checkpoints on disk: the directory layout, and reading files without running the code they may carry."""
