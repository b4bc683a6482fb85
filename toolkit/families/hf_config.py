"""A Hugging Face config.json read into gridwright's model config through the family
declarations, and written back by transformers' own config classes.

config.json is read through `transformers.AutoConfig`, so a field the file leaves out
gets the value transformers itself would use (Mistral's sliding window, Mixtral's rope
theta...), and legacy spellings (`rope_theta` + `rope_scaling`) are normalised as
transformers does. Every field that changes the computation is then either mapped onto
gridwright's ModelConfig or refused with the reason. Refusing is the point: a sliding
window, an unknown rope scaling, a bias Megatron-Core's layer would not apply would each
give a model that loads and then computes something else.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from .declaration import Family, UnsupportedModel
from .registry import FAMILIES, family

# Llama-3.x rope scaling as Megatron-Core 0.16.1 implements it (rotary_pos_embedding.py
# `_apply_scaling`): only the factor is configurable there, these three are fixed.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _supported_type(model_type) -> Family:
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(FAMILIES))}."
        )
    return FAMILIES[model_type]


CONFIG_BYTES = 1 << 20  # a model's config.json is a few kB


def raw_hf_config(hf_dir: str | Path) -> dict:
    """config.json as written (a small regular file of the folder; never a link out, a FIFO
    or a device), its model type one gridwright supports."""
    from ..basics.path_rules import PathRefused, model_folder_file, read_bounded_text

    path = Path(hf_dir) / "config.json"
    try:
        raw = json.loads(read_bounded_text(model_folder_file(hf_dir, "config.json"), CONFIG_BYTES, "a model's config",
                                           follow=True))
    except FileNotFoundError:
        raise UnsupportedModel(f"{path} does not exist: a Hugging Face model folder holds config.json.") from None
    except PathRefused as e:
        raise UnsupportedModel(str(e)) from None
    except json.JSONDecodeError as e:
        raise UnsupportedModel(f"{path} is not valid JSON ({e}).") from e
    if not isinstance(raw, dict):
        raise UnsupportedModel(f"{path} is not a JSON object.")
    _supported_type(raw.get("model_type"))
    return raw


def read_hf_config(hf_dir: str | Path) -> dict:
    """config.json with transformers' defaults filled in (as its model classes would see it)."""
    import transformers

    raw_hf_config(hf_dir)
    path = Path(hf_dir) / "config.json"
    try:
        return transformers.AutoConfig.from_pretrained(str(hf_dir)).to_dict()
    except (ValueError, TypeError, KeyError) as e:
        raise UnsupportedModel(f"transformers cannot read {path}: {e}") from e


def _rope(hf: dict) -> tuple[float, float | None]:
    """(rope theta, Llama-3 scaling factor or None) from either config style.

    transformers 5 writes `rope_parameters` (theta included); older files on the Hub
    carry `rope_theta` and `rope_scaling` at the top level.
    """
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise UnsupportedModel(
            f"rope scaling type '{kind}' is not supported (Megatron-Core 0.16.1 implements Llama-3 scaling only)."
        )
    for key, fixed in LLAMA3_FIXED.items():
        if float(scaling.get(key, fixed)) != fixed:
            raise UnsupportedModel(
                f"Llama-3 rope scaling with {key}={scaling[key]} is not supported: Megatron-Core 0.16.1 fixes it "
                f"at {fixed:g}."
            )
    if "factor" not in scaling:
        raise UnsupportedModel("Llama-3 rope scaling without a 'factor' is incomplete.")
    return float(theta), float(scaling["factor"])


def _refuse_if(condition: bool, reason: str) -> None:
    if condition:
        raise UnsupportedModel(reason)


def model_config_from_hf(hf: dict, name: str) -> dict:
    """gridwright's ModelConfig fields for this Hugging Face config, or UnsupportedModel."""
    fam = _supported_type(hf.get("model_type"))
    archs = hf.get("architectures") or [fam.hf_architecture]
    _refuse_if(archs != [fam.hf_architecture],
               f"architectures {archs} is not [{fam.hf_architecture}] (only causal LM heads convert).")
    _refuse_if(hf.get("hidden_act", "silu") != "silu", f"hidden_act '{hf.get('hidden_act')}' is not silu (SwiGLU).")
    _refuse_if(bool(hf.get("mlp_bias")), "mlp_bias=true is not supported (these families' MLPs have no bias).")
    for refusal in fam.refuses:
        _refuse_if(refusal.when(hf), refusal.reason.format_map(defaultdict(lambda: None, hf)))
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size") if not hf.get(k)]
    _refuse_if(bool(missing), f"config.json lacks {', '.join(missing)}.")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    theta, scaling = _rope(hf)
    cfg = dict(
        name=name,
        family=fam.name,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        # None where it is hidden_size / heads, so configs of the common case stay as they were.
        head_dim=None if head_dim * heads == hidden else head_dim,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rotary_base=theta,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=False,
        rope_scaling_factor=scaling,
        num_experts=0,
        moe_router_topk=2,
        moe_aux_loss_coeff=1e-2,
    )
    for key, (hf_key, default) in fam.hf_fields.items():
        value = hf.get(hf_key, default)
        _refuse_if(value is None, f"config.json lacks {hf_key}.")
        cfg[key] = type(cfg[key])(value) if cfg.get(key) is not None else value
    cfg.update(fam.fixed)
    return cfg


def family_problems(model: dict) -> list[str]:
    """How a gridwright model config departs from its family's declaration (validation
    and the exporter both refuse such a config)."""
    if model.get("family") not in FAMILIES:
        return [f"model.family='{model.get('family')}' is not one of {', '.join(FAMILIES)}. "
                f"Fix: model.family={fitting_family(model)}."]
    fam, out = FAMILIES[model["family"]], []
    if fam.experts != bool(model.get("num_experts")):
        out.append(f"model.family={fam.name} with model.num_experts={model.get('num_experts')}: the {fam.name} "
                   f"family is {'a mixture of experts' if fam.experts else 'dense'} (the family names the Hugging "
                   f"Face architecture). Fix: model.family={fitting_family(model)}.")
    for key, value in _fixed_values(fam).items():
        if model.get(key) != value:
            word = str(value).lower() if isinstance(value, bool) else value
            out.append(f"model.family={fam.name} with model.{key}={model.get(key)}: the {fam.name} family has "
                       f"{key}={value}. Fix: model.{key}={word}.")
    return out


def _fixed_values(family) -> dict:
    """The values a family's models must have (no QKV bias unless the family says so)."""
    return dict({"qkv_bias": False}, **family.fixed)


def fitting_family(model: dict) -> str:
    """The family this model's shape belongs to: dense or experts as the model is, with
    every fixed value the model has; the nearest name to the one given first."""
    import difflib

    kind = [f for f in FAMILIES.values() if f.experts == bool(model.get("num_experts"))]
    fitting = [f.name for f in kind if all(model.get(k) == v for k, v in _fixed_values(f).items())]
    names = fitting or [f.name for f in kind]
    near = difflib.get_close_matches(str(model.get("family")), names, n=1, cutoff=0.0)
    return near[0] if near else names[0]


def head_dim(model) -> int:
    """The head size: model.head_dim, or hidden_size / heads where it is None (the form
    model_config_from_hf stores when the two agree)."""
    return model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]


def same_model(recorded: dict, model: dict) -> bool:
    """Whether two model configs describe the same model: fields only one of them has (a
    record written before the field existed) are not compared, and the head size is
    compared as a size (None and hidden / heads are the same)."""
    shared = (set(recorded) & set(model)) - {"head_dim"}
    return all(recorded[k] == model[k] for k in shared) and head_dim(recorded) == head_dim(model)


def transformers_config(model: dict):
    """The transformers config object of a gridwright model config (the DeepSpeed engine
    builds its model from it; the exporter writes it as config.json)."""
    import transformers

    problems = family_problems(model)
    if problems:
        raise UnsupportedModel(" ".join(problems))
    fam = family(model["family"])
    rope = {"rope_type": "default", "rope_theta": float(model["rotary_base"])}
    if model.get("rope_scaling_factor") is not None:
        rope.update(rope_type="llama3", factor=float(model["rope_scaling_factor"]), **LLAMA3_FIXED)
    kwargs = dict(
        vocab_size=model["vocab_size"],
        hidden_size=model["hidden_size"],
        intermediate_size=model["ffn_hidden_size"],
        num_hidden_layers=model["num_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_query_groups"],
        max_position_embeddings=model["max_position_embeddings"],
        rms_norm_eps=model["norm_epsilon"],
        tie_word_embeddings=model["tie_embeddings"],
        rope_parameters=rope,
        hidden_act="silu",
    )
    if model.get("head_dim"):
        kwargs["head_dim"] = model["head_dim"]
    for key, value in fam.hf_export.items():  # "{field}" strings take the model's value, typed
        if isinstance(value, str) and re.fullmatch(r"\{\w+\}", value):
            value = model[value[1:-1]]
        kwargs[key] = value
    config = getattr(transformers, fam.hf_config_class)(**kwargs)
    if getattr(config, "head_dim", None) not in (None, head_dim(model)):
        config.head_dim = head_dim(model)  # a class default other than hidden / heads (Qwen3's is 128)
    config.architectures = [fam.hf_architecture]
    return config


def hf_config_from_model(model: dict, dtype: str) -> dict:
    """A Hugging Face config.json (as a dict) for a gridwright model config.

    Built by `transformers`' own config classes so every default they write is theirs.
    """
    return dict(transformers_config(model).to_dict(), dtype=dtype)


def default_model_name(hf_dir: str | Path) -> str:
    """A config-group-safe name from the source folder's name."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", Path(hf_dir).resolve().name).strip("_").lower()
    return name or "converted"
