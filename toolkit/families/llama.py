"""Llama 1, 2 and 3.x (LlamaForCausalLM): RMSNorm, SwiGLU, rotary (Llama-3 scaling), GQA."""
from .common import ATTENTION, ATTENTION_OUT, DENSE_MLP, EMBEDDING, FINAL, NO_ATTENTION_BIAS
from .declaration import Family

FAMILY = Family(
    name="llama",
    hf_architecture="LlamaForCausalLM",
    hf_config_class="LlamaConfig",
    weights=EMBEDDING + ATTENTION + ATTENTION_OUT + DENSE_MLP + FINAL,
    refuses=(NO_ATTENTION_BIAS,),
    hf_export={"attention_bias": False, "mlp_bias": False},
    tiny={
        "llama": {},
        # Llama 1/2: multi-head attention (as many key/value heads as query heads).
        "llama2_mha": {"num_key_value_heads": 4},
        # Llama 3.x: rope scaling, large theta, tied embeddings (as Llama-3.2-1B).
        "llama3_tied": {
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        },
    },
)
