"""Megatron-Core's checkpoint and optimizer internals that gridwright reaches into.

The converter writes Megatron-Core distributed checkpoints itself (streaming, without
building a model), so it must write the metadata Megatron-Core's own save writes; the
engine's save and load need two private calls. All are true of the tested release.
"""
from __future__ import annotations

import queue

# What dist_checkpointing writes into metadata.json for torch_dist
# (dist_checkpointing/core.py CheckpointingConfig, strategies/torch.py backend version 1).
TORCH_DIST_METADATA = {
    "sharded_backend": "torch_dist", "sharded_backend_version": 1,
    "common_backend": "torch", "common_backend_version": 1,
}

CITED = [
    # the private helper materialise_distributed_optimizer_states calls
    ("optimizer/distrib_optimizer.py", "def _init_optimizer_states_with_dummy_values(self):"),
    # the step extraction that fails on a fresh optimizer without Apex/TE (no states yet)
    ("optimizer/distrib_optimizer.py", 'steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))'),
    # the private queue write_results_in_process sets
    ("dist_checkpointing/strategies/filesystem_async.py", "_results_queue = None"),
]


def materialise_distributed_optimizer_states(optimizer) -> None:
    """A fresh distributed optimizer has no Adam states yet, and without Apex or TE its
    `state_dict()` fails on that (distrib_optimizer.py:641) before loading can fill them.
    Megatron-Core's own private helper creates placeholder states that the load overwrites."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def write_results_in_process() -> None:
    """Give Megatron's checkpoint writer a results queue inside this process.

    Its first save otherwise starts a `spawn` multiprocessing Manager to hold the queue: a
    fresh interpreter with SIGTERM's default action. Slurm signals every process of a job
    step, more than once, so on scancel the Manager died mid stop-save and the save failed
    with EOFError (seen in CI). The queue only carries results between processes for
    Megatron's async save; gridwright saves synchronously (the write runs in this process),
    so a plain queue does. This sets a private module global of filesystem_async.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
