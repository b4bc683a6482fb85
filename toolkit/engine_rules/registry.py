"""The one place that picks an engine by `engine.name`. Everything else asks the engine's
rules (torch-free: validation and planning read them) or its trainer, never its name.
A rules module names its trainer module (`TRAINER_MODULE`), which the training loop opens."""
from __future__ import annotations

import importlib

from ..config.schema import ENGINES


def is_known(engine) -> bool:
    """Whether `engine.name` names an engine (validation says so in one line otherwise)."""
    return engine.name in ENGINES


def rules(engine):
    """The torch-free rules module of the engine group's engine (see `protocol`)."""
    if engine.name not in ENGINES:
        raise ValueError(f"engine.name='{engine.name}' is not one of {', '.join(ENGINES)}.")
    return importlib.import_module(f"{__package__}.{engine.name}_rules")
