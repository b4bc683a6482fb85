"""Launchers: how a validated job starts (local torchrun, multi-node torchrun, Slurm, plan-only), the agent that owns it on each node, and the worker process each rank runs."""
