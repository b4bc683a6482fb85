"""Parameter counts and FLOPs of a Llama/Mixtral-shaped decoder, from its config alone.

MFU definition used everywhere in gridwright (stated so numbers are comparable):

    model FLOPs per token = 3 x forward FLOPs per token            (backward = 2 x forward)
    forward FLOPs per token = 2 x (active matmul parameters)        (one multiply-add = 2 FLOPs)
                            + 4 x layers x seq_length x hidden      (QK^T and attention x V,
                                                                     full S x S, causal mask
                                                                     not discounted, as in
                                                                     Megatron-LM and PaLM)
    active matmul parameters = per layer: QKV + output projection + router
                               + top-k experts (or the dense MLP) x 3 matrices (SwiGLU)
                               + the output layer (hidden x vocab); embeddings excluded.
    MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak (or fp8 peak when
          training in FP8).
HFU adds the recomputed forward passes: 4 x forward with full recompute.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding
    output: int  # output layer (0 when tied to the embedding)
    attention_per_layer: int  # QKV + output projection
    norms_per_layer: int
    dense_mlp_per_layer: int  # 0 for MoE models
    router_per_layer: int
    expert_per_layer: int  # all experts of one layer
    num_layers: int

    @property
    def per_layer_dense(self) -> int:
        return self.attention_per_layer + self.norms_per_layer + self.dense_mlp_per_layer + self.router_per_layer

    @property
    def total(self) -> int:
        return (
            self.embedding + self.output + self.num_layers * (self.per_layer_dense + self.expert_per_layer)
        )


def param_counts(model) -> ParamCounts:
    h, f, L = model.hidden_size, model.ffn_hidden_size, model.num_layers
    heads, groups, V = model.num_attention_heads, model.num_query_groups, model.vocab_size
    head_dim = h // heads
    qkv = h * (heads + 2 * groups) * head_dim
    attn = qkv + heads * head_dim * h
    mlp_one = 3 * h * f  # SwiGLU: gate, up, down
    moe = model.num_experts > 0
    return ParamCounts(
        embedding=V * h,
        output=0 if model.tie_embeddings else V * h,
        attention_per_layer=attn,
        # QKV biases (Qwen2) sit with the norms: parameters that are not matmul FLOPs.
        norms_per_layer=2 * h + (heads + 2 * groups) * head_dim * bool(getattr(model, "qkv_bias", False)),
        dense_mlp_per_layer=0 if moe else mlp_one,
        router_per_layer=h * model.num_experts if moe else 0,
        expert_per_layer=model.num_experts * mlp_one if moe else 0,
        num_layers=L,
    )


def forward_flops_per_token(model, seq_length: int) -> float:
    h, f, L, V = model.hidden_size, model.ffn_hidden_size, model.num_layers, model.vocab_size
    pc = param_counts(model)
    mlp_active = (model.moe_router_topk * 3 * h * f) if model.num_experts else pc.dense_mlp_per_layer
    matmul_params = L * (pc.attention_per_layer + pc.router_per_layer + mlp_active) + h * V
    return 2.0 * matmul_params + 4.0 * L * seq_length * h


def model_flops_per_token(model, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU."""
    return 3.0 * forward_flops_per_token(model, seq_length)


def hardware_flops_per_token(model, seq_length: int, recompute: str) -> float:
    """FLOPs the hardware executes, counting recomputed forward passes (HFU)."""
    extra = {"none": 0.0, "selective": 0.0, "full": 1.0}[recompute]
    return (3.0 + extra) * forward_flops_per_token(model, seq_length)
