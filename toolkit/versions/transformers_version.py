"""Which transformers the DeepSpeed engine's Hugging Face models are tested with.

engine=deepspeed trains transformers' own model classes (`gridwright.engines.hf_model`),
drawn by Megatron-Core's initialisation rules and checked against the Megatron engine step
by step. Their module and parameter names and their activation-checkpointing calls are one
release's. GPU machines often carry another transformers: on one H200 machine the DeepSpeed
run failed inside its rank ('LlamaForCausalLM' object has no attribute
'is_activation_checkpointing'). The version is read from the distribution's metadata, so
validation refuses before start without importing transformers (seconds).
"""
from __future__ import annotations

import importlib.metadata
import sys

from .version_fence import VersionFence

TESTED = "5.24.0"
OVERRIDE = "GRIDWRIGHT_UNTESTED_TRANSFORMERS"  # =1: try another version anyway, loudly


class UntestedTransformers(RuntimeError):
    """The installed transformers is not the tested release."""


def installed_version() -> str | None:
    """`transformers.__version__`, or None without transformers."""
    if "transformers" in sys.modules:
        return getattr(sys.modules["transformers"], "__version__", None)
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


FENCE = VersionFence("transformers", "transformers", TESTED, OVERRIDE,
                     "the Hugging Face model classes engine=deepspeed trains", "gridwright.engines.hf_model",
                     lambda: installed_version(), UntestedTransformers)
version_problem = FENCE.version_problem
refusal = FENCE.refusal
refuse_untested = FENCE.refuse_untested
