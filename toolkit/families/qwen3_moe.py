"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (QK-norm) with a top-k mixture of
SwiGLU experts in every layer and no shared expert (Qwen3-30B-A3B, Qwen3-235B-A22B).

Megatron-Core's default router (top-k, then softmax over the chosen k) is Hugging Face's
norm_topk_prob=true, which those releases set; without renormalisation is refused.
Experts use moe_intermediate_size; intermediate_size only sizes dense layers, of which
a converted model has none (mlp_only_layers empty, decoder_sparse_step 1), so an export
writes it equal to moe_intermediate_size.
"""
from .common import (ATTENTION, ATTENTION_OUT, EMBEDDING, FINAL, L, MOE_FIELDS, NO_ATTENTION_BIAS,
                     NO_QWEN_SLIDING_WINDOW, QK_NORM)
from .declaration import Family, Refusal, Rule

MOE = L + "mlp."
EXPERTS = (
    Rule("decoder.layers.mlp.router.weight", MOE + "gate.weight"),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight",
         (MOE + "experts.{expert}.gate_proj.weight", MOE + "experts.{expert}.up_proj.weight"), "gated_mlp"),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", MOE + "experts.{expert}.down_proj.weight"),
)

FAMILY = Family(
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    hf_config_class="Qwen3MoeConfig",
    weights=EMBEDDING + ATTENTION + QK_NORM + ATTENTION_OUT + EXPERTS + FINAL,
    experts=True,
    # transformers reads a file's num_experts as num_local_experts (its attribute map).
    hf_fields={"num_experts": ("num_local_experts", 128), "ffn_hidden_size": ("moe_intermediate_size", None), **MOE_FIELDS},
    refuses=(
        NO_ATTENTION_BIAS, NO_QWEN_SLIDING_WINDOW,
        Refusal(lambda hf: not hf.get("norm_topk_prob"),
                "norm_topk_prob=false (top-k probabilities not renormalised) is not supported; Megatron-Core's "
                "default router renormalises, as Qwen3-MoE releases do (norm_topk_prob=true)."),
        Refusal(lambda hf: bool(hf.get("mlp_only_layers")),
                "mlp_only_layers={mlp_only_layers} (dense layers among the MoE ones) is not supported."),
        Refusal(lambda hf: int(hf.get("decoder_sparse_step", 1)) != 1,
                "decoder_sparse_step={decoder_sparse_step} (MoE only every few layers) is not supported."),
    ),
    hf_export={"use_sliding_window": False, "attention_bias": False, "norm_topk_prob": True, "mlp_only_layers": [],
               "decoder_sparse_step": 1, "num_experts": "{num_experts}", "num_experts_per_tok": "{moe_router_topk}",
               "router_aux_loss_coef": "{moe_aux_loss_coeff}", "moe_intermediate_size": "{ffn_hidden_size}"},
    megatron={"qk_layernorm": True},
    tiny={"qwen3_moe": {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                        "norm_topk_prob": True}},
)
