"""Megatron-Core's checkpoint and optimizer internals that gridwright reaches into.

The converter writes Megatron-Core distributed checkpoints itself (streaming, without
building a model), so it must write the metadata Megatron-Core's own save writes; the
engine's save and load need two private calls. All are true of the tested release.
"""
from __future__ import annotations

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
    # the private queue results_queue_across_fork sets
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


class _ResultsAcrossFork:
    """What Megatron's writer puts its results into and its finalize takes them from
    (`put`, `get_nowait`), across a fork: the background writer is a forked child and the
    finalize runs in the training process. A pipe carries them and a thread of the training
    process drains it at once, so a child's large results never block its exit (a plain
    multiprocessing queue would: its feeder thread waits for a reader at the child's exit,
    while the parent reads only once the child has exited)."""

    _WAIT_S = 30.0  # the finalize asks only after the writer ended: its results are in the pipe

    def __init__(self):
        import multiprocessing
        import queue
        import threading

        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._received = queue.Queue()
        threading.Thread(target=self._drain, name="gridwright-ckpt-results", daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                self._received.put(self._reader.recv())
            except (EOFError, OSError):
                return

    def put(self, item) -> None:
        self._writer.send(item)

    def get_nowait(self):
        return self._received.get(timeout=self._WAIT_S)  # raises queue.Empty, as Megatron expects


def results_queue_across_fork() -> None:
    """Give Megatron's checkpoint writer a results queue that works in this process and
    across a fork, without a process of its own.

    Its first save otherwise starts a `spawn` multiprocessing Manager to hold the queue: a
    fresh interpreter with SIGTERM's default action. Slurm signals every process of a job
    step, more than once, so on scancel the Manager died mid stop-save and the save failed
    with EOFError (seen in CI); and a Manager outlives a SIGKILL of its parent. Synchronous
    saves write in this process, background saves in a forked child (Megatron-Core's
    TemporalAsyncCaller): `_ResultsAcrossFork` serves both. This sets a private module
    global of filesystem_async.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(getattr(filesystem_async, "_results_queue", None), _ResultsAcrossFork):
        filesystem_async._results_queue = _ResultsAcrossFork()
