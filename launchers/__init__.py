"""Launchers: how a validated job starts (local torchrun, multi-node torchrun, Slurm, plan-only)."""
