"""Notes that name settings measured faster for a run's layout on GPUs.

The host-bound layouts have recipes that were measured (docs/performance.md, 2 x H200): a
user who composes TP with SP, or CP, gets the eager defaults unless told. A note is
printed with the plan only on CUDA, only where the run has not chosen the recipe already,
and only where the config with the recipe still validates (recompute, packing, MoE and FP8
rule some of it out), so that following it leads to a run that starts.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from ..planning.layout import ParallelLayout
from .validation import ConfigError, validate


@dataclass(frozen=True)
class Recipe:
    settings: tuple[tuple[str, object], ...]  # (dotted key, value)
    measured: str  # what it gave, where, and the file that says so

    def missing(self, cfg) -> list[tuple[str, object]]:
        return [(k, v) for k, v in self.settings if _get(cfg, k) != v]


TP_RECIPE = Recipe(
    (("engine.compile_layers", True), ("engine.tp_comm_overlap", True), ("engine.cuda_graphs", "layers")),
    "TP=2+SP of the bench model ran 40.6 % MFU with them against 33.3 % eager, and the Llama-3-8B shape "
    "43.6 % (2 x H200, evaluations/results/bench_gpu_2xh200_20261128-2041.md); async TP without "
    "CUDA graphs was slower than eager there")
CP_RECIPE = Recipe(
    (("parallel.cp_comm_type", "a2a"),),
    "CP=2 of the bench model ran 36.9 % MFU by all-to-all against 33.3 % by all-gather in one call "
    "(2 x H200, evaluations/results/bench_gpu_2xh200_20261128-2016.md)")


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _text(settings) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings)


def recipes_for(cfg) -> list[Recipe]:
    """The measured recipes whose layout this run has (not whether they validate)."""
    if cfg.cluster.device != "cuda" or cfg.engine.name != "megatron":
        return []
    layout, out = ParallelLayout.from_config(cfg), []
    if layout.tp > 1 and layout.sp:
        out.append(TP_RECIPE)
    if layout.cp > 1 and cfg.parallel.cp_mode == "static":
        out.append(CP_RECIPE)
    return out


def speed_notes(cfg) -> list[str]:
    notes = []
    for recipe in recipes_for(cfg):
        missing = recipe.missing(cfg)
        if not missing:
            continue
        # CUDA graphs cannot capture recomputation: where memory allows, the recipe drops it.
        for extra in ([], [("train.recompute", "none")] if cfg.train.recompute != "none" else None):
            if extra is not None and _validates(cfg, missing + extra):
                notes.append(f"measured faster for this layout: {_text(missing + extra)}. {recipe.measured}.")
                break
    return notes


def _validates(cfg, settings) -> bool:
    trial = copy.deepcopy(cfg)
    for key, value in settings:
        parent, _, leaf = key.rpartition(".")
        _get(trial, parent)[leaf] = value
    try:
        validate(trial, for_launch=False)
    except ConfigError:
        return False
    return True
