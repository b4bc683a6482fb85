"""Warnings the stack prints that say nothing a gridwright user can act on, filtered.

Each entry is (message regex, category, why it does not apply). They are expected on
every machine this toolkit runs on, or on the machine kind named, and the README states
the facts they carry once (no Transformer Engine or Apex here; Megatron-Core's own
deprecations). Anything not listed still prints.
"""
from __future__ import annotations

import warnings

EVERYWHERE = (
    ("Transformer Engine and Apex are not installed", UserWarning,
     "Megatron-Core uses its torch fallbacks; the README says so"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning,
     "the same fact, once per layer-spec module"),
    ("full scope is deprecated. Use empty cuda_graph_scope", UserWarning,
     "Megatron-Core 0.16.1's own TransformerConfig default triggers it; no CUDA graphs are used"),
    (r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
     "called inside Megatron-Core and DeepSpeed, once per call site (hundreds of lines under ZeRO-3)"),
    ("`load_state_dict` is deprecated and will be removed in future versions", FutureWarning,
     "torch.distributed.checkpoint's deprecation, called inside Megatron-Core's checkpoint loading"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     "Megatron-Core 0.16.1's distributed checkpoints are built on ShardedTensor"),
    ("The pad token id in the tokenizer collides with another special token id", UserWarning,
     "gridwright's tokenizers pad with end-of-document; packed GPT samples have no padding to mask"),
)
ON_CPU = (
    ("it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
     "a CUDA stream setting; the GPU launchers set it, a CPU run has no streams"),
)


# Loggers quietened to errors: (logger, why its warnings do not apply).
LOGGERS = (
    ("torchao", "at import it reports its optional CUDA extensions (MXFP8, CUTLASS) that do not load here; "
                "the float8 training gridwright uses is plain PyTorch"),
    ("torch.utils._pytree", "torchao 0.18 registers an Enum the way torch 2.11+ deprecates, once per process"),
)


def filter_known_warnings(device: str | None = None) -> None:
    """Install the filters (`device` 'cpu' adds the CPU-only ones)."""
    import logging

    for name, _why in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message, category, _why in EVERYWHERE + (ON_CPU if device == "cpu" else ()):
        warnings.filterwarnings("ignore", message=f".*{message}", category=category)
