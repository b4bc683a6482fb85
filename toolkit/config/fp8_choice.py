"""Whose FP8 a run gets, Transformer Engine's or torchao's: one rule for validation, the
speed notes and the model builder."""
from __future__ import annotations


def fp8_backend(precision, te_available: bool):
    """Whose FP8 runs: "transformer_engine", "torchao", or None (no FP8). `auto` takes
    Transformer Engine where it imports, else torchao; rowwise exists only in torchao."""
    if precision.fp8_recipe is None:
        return None
    if precision.fp8_backend == "auto":
        return "transformer_engine" if te_available and precision.fp8_recipe != "rowwise" else "torchao"
    return precision.fp8_backend
