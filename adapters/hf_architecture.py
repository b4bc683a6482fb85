"""Which Hugging Face models convert, and the gridwright model config each one becomes.

A Hugging Face `config.json` is read through `transformers.AutoConfig`, so a field the
file leaves out gets the value transformers itself would use (Mistral's sliding window,
Mixtral's rope theta...), and legacy spellings (`rope_theta` + `rope_scaling`) are
normalised as transformers does. Every field that changes the computation is then
either mapped onto gridwright's ModelConfig or refused with the reason. Refusing is the
point: a sliding window, an unknown rope scaling, a bias Megatron-Core's layer would not
apply would each give a model that loads and then computes something else.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

SUPPORTED = {
    # model_type: (architecture class, gridwright family)
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
# Llama-3.x rope scaling as Megatron-Core 0.16.1 implements it (rotary_pos_embedding.py
# `_apply_scaling`): only the factor is configurable there, these three are fixed.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModel(ValueError):
    """The source cannot be converted exactly; nothing was written."""


def read_hf_config(hf_dir: str | Path) -> dict:
    """config.json with transformers' defaults filled in (as its model classes would see it)."""
    import transformers

    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModel(f"{path} does not exist: a Hugging Face model folder holds config.json.")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModel(f"{path} is not valid JSON ({e}).") from e
    if raw.get("model_type") not in SUPPORTED:
        raise UnsupportedModel(
            f"model_type '{raw.get('model_type')}' is not supported; supported: {', '.join(sorted(SUPPORTED))}."
        )
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
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise UnsupportedModel(
            f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(SUPPORTED))}."
        )
    arch, family = SUPPORTED[model_type]
    archs = hf.get("architectures") or [arch]
    _refuse_if(archs != [arch], f"architectures {archs} is not [{arch}] (only causal LM heads convert).")
    _refuse_if(hf.get("hidden_act", "silu") != "silu", f"hidden_act '{hf.get('hidden_act')}' is not silu (SwiGLU).")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    _refuse_if(
        head_dim * heads != hidden,
        f"head_dim={head_dim} x {heads} heads != hidden_size={hidden}: a decoupled head size is not supported.",
    )
    _refuse_if(bool(hf.get("mlp_bias")), "mlp_bias=true is not supported (Llama/Mistral/Qwen2 MLPs have no bias).")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no output-projection bias
        sliding = bool(hf.get("use_sliding_window")) or "sliding_attention" in (hf.get("layer_types") or [])
        _refuse_if(sliding, "Qwen2 with use_sliding_window=true (sliding-window attention) is not supported.")
    else:
        qkv_bias = False
        _refuse_if(
            bool(hf.get("attention_bias")),
            "attention_bias=true (biases on q/k/v and the output projection) is not supported.",
        )
        _refuse_if(
            hf.get("sliding_window") is not None,
            f"sliding_window={hf.get('sliding_window')} (sliding-window attention) is not supported; "
            "only full causal attention converts.",
        )
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size") if not hf.get(k)]
    _refuse_if(bool(missing), f"config.json lacks {', '.join(missing)}.")
    theta, scaling = _rope(hf)
    cfg = dict(
        name=name,
        family=family,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rotary_base=theta,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        rope_scaling_factor=scaling,
        num_experts=0,
        moe_router_topk=2,
        moe_aux_loss_coeff=1e-2,
    )
    if model_type == "mixtral":
        _refuse_if(
            float(hf.get("router_jitter_noise") or 0.0) != 0.0,
            "router_jitter_noise>0 is not supported (Megatron-Core's router has no equivalent input jitter).",
        )
        cfg.update(
            num_experts=hf["num_local_experts"],
            moe_router_topk=hf.get("num_experts_per_tok", 2),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 1e-2)),
        )
    return cfg


def transformers_config(model: dict):
    """The transformers config object of a gridwright model config (the DeepSpeed engine
    builds its model from it; the exporter writes it as config.json)."""
    import transformers

    family = model["family"]
    experts, bias = bool(model.get("num_experts")), bool(model.get("qkv_bias"))
    # Each family is one Hugging Face class: anything it would not compute is refused.
    if (family == "mixtral") != experts:
        raise UnsupportedModel(f"family {family} with num_experts={model.get('num_experts')}: only mixtral has experts.")
    if (family == "qwen2") != bias:
        raise UnsupportedModel(f"family {family} with qkv_bias={bias}: only qwen2 has (and needs) QKV biases.")
    rope = {"rope_type": "default", "rope_theta": float(model["rotary_base"])}
    if model.get("rope_scaling_factor") is not None:
        rope.update(rope_type="llama3", factor=float(model["rope_scaling_factor"]), **LLAMA3_FIXED)
    common = dict(
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
    if family == "mixtral":
        config = transformers.MixtralConfig(
            num_local_experts=model["num_experts"], num_experts_per_tok=model["moe_router_topk"],
            router_aux_loss_coef=model["moe_aux_loss_coeff"], sliding_window=None, **common,
        )
    elif family == "qwen2":
        config = transformers.Qwen2Config(use_sliding_window=False, **common)
    elif family == "mistral":
        config = transformers.MistralConfig(sliding_window=None, **common)
    else:
        config = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    config.architectures = [SUPPORTED[family][0]]
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
