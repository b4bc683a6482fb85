"""The one place that picks an engine by `engine.name`. Everything else asks the engine's
rules (torch-free: validation and planning read them) or its trainer, never its name.
A rules module names its trainer module (`TRAINER_MODULE`), which the training loop opens."""
from __future__ import annotations

import importlib

ENGINES = ("megatron", "deepspeed")


def is_known(cfg) -> bool:
    """Whether `engine.name` names an engine (validation says so in one line otherwise)."""
    return cfg.engine.name in ENGINES


def rules(cfg_or_name):
    """The torch-free rules module of an engine (see `protocol`)."""
    return importlib.import_module(f"{__package__}.{_name(cfg_or_name)}_rules")


def _name(cfg_or_name) -> str:
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.engine.name
    if name not in ENGINES:
        raise ValueError(f"engine.name='{name}' is not one of {', '.join(ENGINES)}.")
    return name
