"""Hydra composition: registers the typed schema and composes experiments from `conf/`.

`launch.py` uses `@hydra.main` (so `--multirun`, `--cfg job` and tab completion work);
tests and tools use `compose_config` with the same config tree.
"""
from __future__ import annotations

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from .schema import RunConfig

CONF_DIR = Path(os.environ.get("GRIDWRIGHT_CONF", Path(__file__).resolve().parents[1] / "conf"))


def register_schema() -> None:
    """Make the typed schema the base of conf/config.yaml (its `run_schema` default)."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


register_schema()


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose an experiment exactly as `python launch.py OVERRIDES...` would."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    return strip_hydra(cfg)


def strip_hydra(cfg: DictConfig) -> DictConfig:
    """The run's own config, resolved, without Hydra's runtime node."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    typed = OmegaConf.structured(RunConfig)
    merged = OmegaConf.merge(typed, container)
    OmegaConf.set_struct(merged, True)
    return merged
