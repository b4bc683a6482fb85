"""Mixtral (MixtralForCausalLM): Mistral's attention with a top-k mixture of SwiGLU experts."""
from .common import (ATTENTION, ATTENTION_OUT, EMBEDDING, FINAL, L, MOE_FIELDS, NO_ATTENTION_BIAS, NO_ROUTER_JITTER,
                     NO_SLIDING_WINDOW)
from .declaration import Family, Rule

MOE = L + "block_sparse_moe."
# transformers 5 fuses the experts in memory but saves (and loads) these per-expert names.
EXPERTS = (
    Rule("decoder.layers.mlp.router.weight", MOE + "gate.weight"),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight",
         (MOE + "experts.{expert}.w1.weight", MOE + "experts.{expert}.w3.weight"), "gated_mlp"),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", MOE + "experts.{expert}.w2.weight"),
)

FAMILY = Family(
    name="mixtral",
    hf_architecture="MixtralForCausalLM",
    hf_config_class="MixtralConfig",
    weights=EMBEDDING + ATTENTION + ATTENTION_OUT + EXPERTS + FINAL,
    experts=True,
    hf_fields={"num_experts": ("num_local_experts", 8), **MOE_FIELDS},
    refuses=(NO_ATTENTION_BIAS, NO_SLIDING_WINDOW, NO_ROUTER_JITTER),
    hf_export={"sliding_window": None, "num_local_experts": "{num_experts}", "num_experts_per_tok": "{moe_router_topk}",
               "router_aux_loss_coef": "{moe_aux_loss_coeff}"},
    tiny={"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}},
)
