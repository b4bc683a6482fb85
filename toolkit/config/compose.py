"""Hydra composition: registers the typed schema and composes experiments from `conf/`.

`launch.py` uses `@hydra.main` (so `--multirun`, `--cfg job` and tab completion work);
tests and tools use `compose_config` with the same config tree.
"""
from __future__ import annotations

import functools

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ..basics.conf_dir import CONF_DIR, PRESET_GROUPS
from .schema import RunConfig

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
    """The run's own config, named, then resolved, without Hydra's runtime node. Naming comes
    first so that `${name}` in a value (`checkpoint.save=ckpt/${name}`) sees the name."""
    container = OmegaConf.to_container(cfg, resolve=False)
    container.pop("hydra", None)
    typed = OmegaConf.structured(RunConfig)
    merged = OmegaConf.merge(typed, container)
    if merged.name is None:
        merged.name = derived_name(merged)
    OmegaConf.resolve(merged)
    OmegaConf.set_struct(merged, True)
    return merged


# Groups that change what is trained and where; launcher and tracking do not, and the
# layout is in every run's name already.
NAMING_GROUPS = ("cluster", "engine", "zero", "precision")


@functools.lru_cache(maxsize=1)
def root_config() -> DictConfig:
    """conf/config.yaml as written (its defaults list and the root's own values)."""
    return OmegaConf.load(CONF_DIR / "config.yaml")


@functools.lru_cache(maxsize=1)
def root_defaults() -> dict[str, str]:
    """Each group's default option in conf/config.yaml (`model: tiny_llama`, ...)."""
    defaults = root_config().defaults
    return {k: v for entry in defaults if isinstance(entry, DictConfig) for k, v in entry.items()
            if isinstance(v, str) and not k.startswith("override")}


def group_choices(cfg) -> dict[str, str]:
    """The option of each naming group that the composed values correspond to."""
    z = cfg.zero
    return {
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "engine": cfg.engine.name,
        "zero": f"stage{z.stage}" + ("_offload" if z.offload_optimizer or z.offload_params else ""),
        "precision": cfg.precision.name,
    }


def derived_name(cfg) -> str:
    """A run without a preset is named after its model and each group chosen away from the
    defaults: `tiny_llama`, `llama3_8b-dgx_h100`, `tiny_llama-deepspeed-stage3`. Without
    this every such run would file itself under the default experiment's name."""
    chosen, defaults = group_choices(cfg), root_defaults()
    parts = [chosen["model"]] + [chosen[g] for g in NAMING_GROUPS if chosen[g] != defaults.get(g)]
    return "-".join(parts)


def presets_for_model(model: str) -> list[tuple[str, str]]:
    """(group, name) of the presets (conf/experiment/, conf/bench/) that choose this model."""
    out = []
    for group in PRESET_GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            defaults = OmegaConf.load(path).get("defaults") or []
            if any(isinstance(e, DictConfig) and e.get("override /model") == model for e in defaults):
                out.append((group, path.stem))
    return out


def preset_sets_train(group: str, name: str) -> bool:
    """Whether a preset, or one it builds on (in its group), sets its own training settings
    (train.seq_length) rather than keeping the root's."""
    preset = OmegaConf.load(CONF_DIR / group / f"{name}.yaml")
    if "seq_length" in (preset.get("train") or {}):
        return True
    return any(isinstance(e, str) and e != "_self_" and preset_sets_train(group, e) for e in preset.get("defaults") or [])


def composition_notes(cfg) -> list[str]:
    """Root defaults that a run probably did not mean to keep: worth a word, not a refusal.

    The root config is sized for the tiny model on a CPU; choosing a large model or a GPU
    cluster without a preset keeps its training settings and fp32 unless told otherwise.
    A note suggests only what is not chosen already: no preset the run was composed from,
    and none where a preset of the model keeps the root's settings itself (they suit it).
    """
    notes = []
    root = root_config()
    kept = {k: v for k, v in root.train.items() if cfg.train[k] == v}
    presets = presets_for_model(cfg.model.name)
    if (cfg.model.name != root_defaults().get("model") and "seq_length" in kept
            and cfg.name not in {name for _, name in presets} and all(preset_sets_train(*p) for p in presets)):
        # A run composed from a preset swaps it (`experiment=X`); `+experiment=X` would add a second.
        plus = "" if any((CONF_DIR / g / f"{cfg.name}.yaml").is_file() for g in PRESET_GROUPS) else "+"
        hint = (f"start from a preset for {cfg.model.name} (" + ", ".join(f"{plus}{g}={p}" for g, p in presets)
                + ") or set them" if presets else "set them")
        notes.append(
            f"these train.* values are the root defaults, sized for {root_defaults()['model']} on a CPU: "
            + ", ".join(f"{k}={v}" for k, v in kept.items()) + f". For {cfg.model.name}, {hint}."
        )
    if cfg.cluster.device == "cuda" and cfg.precision.params_dtype == "fp32":
        notes.append(
            "precision=fp32 on GPUs (the CPU default): training runs in fp32 while MFU divides by the bf16 "
            "peak. Set precision=bf16 unless fp32 is what you want."
        )
    return notes
