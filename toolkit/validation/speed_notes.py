"""Notes that name settings measured faster for a run's layout on GPUs.

Measured choices of one setting are defaults (`auto`: the float8 output layer, the static CP
exchange, the CP scheduler). What stays a note is TP+SP's recipe on GPUs (compiled layers,
async TP and CUDA graphs together, docs/performance.md): CUDA graphs cannot capture
recomputation and hold more memory, so it is named where it validates, not imposed. The engine's rules say
which recipes its layout has (`measured_recipes`); a note names one only where the run
has not chosen it already and where the config with it still validates (recompute,
packing, MoE and FP8 rule some of it out), so that following it leads to a run that starts.
"""
from __future__ import annotations

import copy

from omegaconf import OmegaConf

from ..engine_rules.registry import rules
from ..planning.layout import ParallelLayout
from .validate import ConfigError, validate


def speed_notes(cfg) -> list[str]:
    notes = []
    for recipe in rules(cfg.engine).measured_recipes(cfg, ParallelLayout.from_config(cfg)):
        missing = [(k, v) for k, v in recipe.settings if OmegaConf.select(cfg, k) != v]
        if not missing:
            continue
        candidates = [missing]
        if cfg.train.recompute != "none":  # CUDA graphs cannot capture recomputation: drop it where memory allows
            candidates.append(missing + [("train.recompute", "none")])
        settings = next((c for c in candidates if _validates(cfg, c)), None)
        if settings:
            notes.append(f"measured faster for this layout: {_text(settings)}. {recipe.measured}.")
    return notes


def _text(settings) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings)


def _validates(cfg, settings) -> bool:
    trial = copy.deepcopy(cfg)
    for key, value in settings:
        OmegaConf.update(trial, key, value)
    try:
        validate(trial, for_launch=False)
    except ConfigError:
        return False
    return True
