"""Mistral (MistralForCausalLM): Llama's computation; only full attention (no sliding window) converts."""
from .common import ATTENTION, ATTENTION_OUT, DENSE_MLP, EMBEDDING, FINAL, NO_ATTENTION_BIAS, NO_SLIDING_WINDOW
from .declaration import Family

FAMILY = Family(
    name="mistral",
    hf_architecture="MistralForCausalLM",
    hf_config_class="MistralConfig",
    weights=EMBEDDING + ATTENTION + ATTENTION_OUT + DENSE_MLP + FINAL,
    refuses=(NO_ATTENTION_BIAS, NO_SLIDING_WINDOW),
    hf_export={"sliding_window": None},
    tiny={"mistral": {"sliding_window": None}},
)
