"""How checkpoints are written: the rule behind `checkpoint.async_save`, which the plan prints.

Measured by `evaluations/bench_checkpoint.py` on the 2-core development machine (2 CPU
processes, docs/performance.md "Checkpoint saves"): a background save stalls training for
6-13 % of a synchronous save's stall on a model whose save takes over 2 s, but the writer
then shares the machine's two cores with training and the steps slow down by more than
the stall saved, so on CPU `auto` saves synchronously. On CUDA the steps run on the GPU and
the writer on host cores they leave idle, so `auto` writes in the background; that choice
is not yet measured on a GPU here (the Llama-3-8B shape's checkpoint, about 63 GB, does
not fit twice on the GPU machines' 64 GiB disk). Its cost is host memory: on CUDA a copy
of each rank's part of the checkpoint; on CPU the pages training changes while the forked
writer still holds the old ones, at most the same.
"""
from __future__ import annotations

from .disk_space import checkpoint_bytes, size_text

WHY_AUTO = {
    "cuda": "the writer runs on host cores the GPU steps leave idle; not yet measured on a GPU",
    "cpu": "on CPU the writer shares the cores with training: measured slower in total",
}


def saves_in_background(checkpoint, device: str) -> bool:
    """Whether this run's periodic saves are written in the background."""
    if checkpoint.async_save is not None:
        return bool(checkpoint.async_save)
    return device == "cuda"


def save_mode_line(checkpoint, model, precision, cluster) -> str | None:
    """The plan's line on how saves are written, and what the background costs in host memory."""
    if not checkpoint.save:
        return None
    why = f"checkpoint.async_save=auto: {WHY_AUTO.get(cluster.device, WHY_AUTO['cpu'])}" \
        if checkpoint.async_save is None else f"checkpoint.async_save={str(bool(checkpoint.async_save)).lower()}"
    if not saves_in_background(checkpoint, cluster.device):
        return f"synchronous, training waits for each write ({why})"
    staged = checkpoint_bytes(model, precision) / max(1, cluster.nodes)
    return (f"in the background ({why}); staging takes up to {size_text(staged)} of host memory per node; "
            f"a save due during a write: {checkpoint.async_busy} (checkpoint.async_busy)")
