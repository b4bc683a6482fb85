"""Qwen3 (Qwen3ForCausalLM): Llama with a per-head RMSNorm on queries and keys (QK-norm)
and a head size that need not be hidden_size / heads (Qwen3-0.6B: 16 heads of 128 over 1024).

This file is the whole of gridwright's Qwen3 support: it was added as a declaration alone.
"""
from .common import (ATTENTION, ATTENTION_OUT, DENSE_MLP, EMBEDDING, FINAL, NO_ATTENTION_BIAS, NO_QWEN_SLIDING_WINDOW,
                     QK_NORM)
from .declaration import Family

FAMILY = Family(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    hf_config_class="Qwen3Config",
    weights=EMBEDDING + ATTENTION + QK_NORM + ATTENTION_OUT + DENSE_MLP + FINAL,
    refuses=(NO_ATTENTION_BIAS, NO_QWEN_SLIDING_WINDOW),
    hf_export={"use_sliding_window": False, "attention_bias": False},
    megatron={"qk_layernorm": True},
    # head_dim 32 over hidden 64 / 4 heads: the decoupled head size is exercised.
    tiny={"qwen3": {"head_dim": 32, "tie_word_embeddings": True}},
)
