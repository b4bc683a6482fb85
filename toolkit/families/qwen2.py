"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama with biases on q, k and v (none on the output projection)."""
from .common import ATTENTION, ATTENTION_OUT, DENSE_MLP, EMBEDDING, FINAL, NO_QWEN_SLIDING_WINDOW, QKV_BIAS
from .declaration import Family

FAMILY = Family(
    name="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    hf_config_class="Qwen2Config",
    weights=EMBEDDING + ATTENTION + QKV_BIAS + ATTENTION_OUT + DENSE_MLP + FINAL,
    fixed={"qkv_bias": True},  # Qwen2 always has them, whatever config.json says
    refuses=(NO_QWEN_SLIDING_WINDOW,),
    hf_export={"use_sliding_window": False},
    megatron={"add_qkv_bias": True},
    tiny={"qwen2": {"tie_word_embeddings": True}},
)
