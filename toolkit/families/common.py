"""Weight-table rows and refusals that several families share.

A family file lists its whole table by joining these groups, so reading one file shows
every tensor of that family; this module only saves retyping the Llama skeleton.
"""
from __future__ import annotations

from .declaration import Refusal, Rule

L = "model.layers.{layer}."

EMBEDDING = (Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),)

ATTENTION = (
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", L + "input_layernorm.weight"),
    Rule("decoder.layers.self_attention.linear_qkv.weight", tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"),
         "qkv"),
)
QKV_BIAS = (
    Rule("decoder.layers.self_attention.linear_qkv.bias", tuple(L + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
)
# Per-head RMSNorm of queries and keys before rotary (Qwen3); Megatron-Core's qk_layernorm.
QK_NORM = (
    Rule("decoder.layers.self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight"),
    Rule("decoder.layers.self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight"),
)
ATTENTION_OUT = (
    Rule("decoder.layers.self_attention.linear_proj.weight", L + "self_attn.o_proj.weight"),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", L + "post_attention_layernorm.weight"),
)
DENSE_MLP = (
    Rule("decoder.layers.mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gated_mlp"),
    Rule("decoder.layers.mlp.linear_fc2.weight", L + "mlp.down_proj.weight"),
)
FINAL = (
    Rule("decoder.final_layernorm.weight", "model.norm.weight"),
    # Tied: Megatron-Core keeps only the embedding, Hugging Face writes no lm_head.
    Rule("output_layer.weight", "lm_head.weight", unless="tie_embeddings"),
)

NO_ATTENTION_BIAS = Refusal(
    lambda hf: bool(hf.get("attention_bias")),
    "attention_bias=true (biases on q/k/v and the output projection) is not supported.",
)
NO_SLIDING_WINDOW = Refusal(
    lambda hf: hf.get("sliding_window") is not None,
    "sliding_window={sliding_window} (sliding-window attention) is not supported; only full causal attention "
    "converts.",
)
# Qwen-style configs carry a window that only applies when use_sliding_window is set.
NO_QWEN_SLIDING_WINDOW = Refusal(
    lambda hf: bool(hf.get("use_sliding_window")) or "sliding_attention" in (hf.get("layer_types") or []),
    "use_sliding_window=true (sliding-window attention) is not supported.",
)
NO_ROUTER_JITTER = Refusal(
    lambda hf: float(hf.get("router_jitter_noise") or 0.0) != 0.0,
    "router_jitter_noise>0 is not supported (Megatron-Core's router has no equivalent input jitter).",
)
# Hugging Face's MoE load-balancing loss and top-k renormalisation as Megatron-Core's
# aux_loss router computes them (softmax, top-k, renormalise).
MOE_FIELDS = {
    "moe_router_topk": ("num_experts_per_tok", 2),
    "moe_aux_loss_coeff": ("router_aux_loss_coef", 1e-2),
}
