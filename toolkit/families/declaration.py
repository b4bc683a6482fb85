"""What a model family declaration is: the facts of one Hugging Face architecture.

A family is data, not code paths. The converter, validation, both engines and the tiny
test models read these fields and nothing else about a family, so adding one is writing
one file (see `qwen3.py`) and naming it in `registry.py`.

The weight table maps Megatron-Core distributed-checkpoint keys to Hugging Face tensor
names with wildcards, as Megatron-Bridge's mapping registries do:

    Rule("decoder.layers.mlp.linear_fc1.weight",
         ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
         "gated_mlp")

Megatron-Core keys carry no index: its checkpoints stack layers on a leading axis and
experts on a second one (that is what makes them independent of TP/PP/EP). The Hugging
Face side names `{layer}` and, for experts, `{expert}`; which of the two it names says
on which axes the Megatron tensor is stacked. Transforms:

    copy        one tensor, unchanged
    gated_mlp   SwiGLU's gate and up projections concatenated along dim 0 (linear_fc1)
    qkv         q, k, v regrouped per key/value group: [q heads of group 0, k0, v0, q heads
                of group 1, k1, v1, ...], the row order of Megatron-Core's fused linear_qkv
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

TRANSFORMS = ("copy", "gated_mlp", "qkv")


class UnsupportedModel(ValueError):
    """The source cannot be converted (or built) exactly; nothing was written."""


@dataclass(frozen=True)
class Rule:
    """One row of a weight table: a Megatron-Core key and the Hugging Face tensors it is made of."""

    megatron: str
    hf: tuple[str, ...] | str
    transform: str = "copy"
    unless: Optional[str] = None  # a boolean model-config field that drops the row (tie_embeddings)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.hf_names[0]

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_names[0]


@dataclass(frozen=True)
class Refusal:
    """A Hugging Face setting this family cannot compute exactly: `when(hf_config)` is
    true for a refused file; `reason` may name fields of it as {field}."""

    when: Callable[[dict], bool]
    reason: str


@dataclass(frozen=True)
class Family:
    """Everything gridwright knows about one model family."""

    name: str  # model.family in gridwright's config; equal to the Hugging Face model_type
    hf_architecture: str  # the causal-LM class: what `architectures` must say
    hf_config_class: str  # transformers' config class, used to export config.json
    weights: tuple[Rule, ...]
    # ModelConfig fields read from config.json beyond the shared ones: field -> (Hugging
    # Face key, default when the file leaves it out).
    hf_fields: dict = field(default_factory=dict)
    # ModelConfig fields this family fixes (Qwen2: qkv_bias=True); validation holds a
    # config to them, the converter sets them.
    fixed: dict = field(default_factory=dict)
    experts: bool = False  # a mixture-of-experts family (num_experts > 0), else dense
    refuses: tuple[Refusal, ...] = ()
    # Keyword arguments for hf_config_class on export, beyond the shared shape (e.g. no
    # sliding window); may name ModelConfig fields as {field} in string values.
    hf_export: dict = field(default_factory=dict)
    # Extra Megatron-Core TransformerConfig arguments (Qwen3: qk_layernorm=True).
    megatron: dict = field(default_factory=dict)
    # Tiny random test models: name -> config-class arguments beyond tiny_models.SHAPE.
    tiny: dict = field(default_factory=dict)

    def __post_init__(self):
        for rule in self.weights:
            if rule.transform not in TRANSFORMS:
                raise ValueError(f"family {self.name}: transform '{rule.transform}' is not one of {TRANSFORMS}")
