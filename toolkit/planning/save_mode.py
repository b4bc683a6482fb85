"""How checkpoints are written: the rule behind `checkpoint.async_save`, which the plan prints.

Measured by `evaluations/bench_checkpoint.py` (docs/performance.md, "Checkpoint saves"):
the background write stalls training for the staging only, a fraction of a synchronous
save's stall on every model and engine measured, so `auto` writes in the background. Its
cost is host memory: on CUDA a copy of each rank's part of the checkpoint; on CPU the pages
training changes while the forked writer still holds the old ones, at most the same.
"""
from __future__ import annotations

from .disk_space import checkpoint_bytes, size_text


def saves_in_background(checkpoint) -> bool:
    """Whether this run's periodic saves are written in the background."""
    return True if checkpoint.async_save is None else bool(checkpoint.async_save)


def save_mode_line(checkpoint, model, precision, nodes: int) -> str | None:
    """The plan's line on how saves are written, and what the background costs in host memory."""
    if not checkpoint.save:
        return None
    why = "checkpoint.async_save=auto: measured faster" if checkpoint.async_save is None \
        else f"checkpoint.async_save={str(bool(checkpoint.async_save)).lower()}"
    if not saves_in_background(checkpoint):
        return f"synchronous: training waits for each write ({why})"
    staged = checkpoint_bytes(model, precision) / max(1, nodes)
    return (f"in the background ({why}); staging holds up to {size_text(staged)} of host memory per node; "
            f"a save due during a write: {checkpoint.async_busy} (checkpoint.async_busy)")
