"""Which torch gridwright is tested with, and the private parts of it gridwright calls.

Two torch releases are in play: 2.13.0 (CPU, this repository's pin and CI) and 2.11.0
(CUDA 13, the GPU machines' image, which cannot be changed there). gridwright calls a few
private torch functions (`PRIVATE_CALLS`, each with where and why); a private function can
change or vanish in any release, so the fence refuses another torch like the Megatron-Core
and DeepSpeed fences do, and a test checks that every call resolves on the installed one.
The version is read from the distribution's metadata: validation refuses before start
without importing torch (seconds).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys

from .version_fence import VersionFence

TESTED = "2.13.0 2.11.0"  # CPU pin first; the GPU machines' CUDA 13 build second
OVERRIDE = "GRIDWRIGHT_UNTESTED_TORCH"  # =1: try another version anyway, loudly

# The private torch attributes gridwright calls: (dotted path, the module that calls it: why).
PRIVATE_CALLS = (
    ("torch._scaled_mm", "torch_internals.float8_gemm: the float8 GEMM where cuBLASLt cannot add in place"),
    ("torch._dynamo.config", "torch_internals.dynamo: the recompile limit for compiled layers"),
    ("torch._dynamo.utils.counters", "torch_internals.dynamo: how many graphs compiled, for the summary"),
    ("torch._utils._rebuild_tensor_v2", "checkpoints.te_extra_state: rebuilds TE's pickled tensors, admitted by name"),
    ("torch.storage._load_from_bytes", "checkpoints.te_extra_state: reads TE's pickled storages through weights-only"),
    ("torch.serialization._get_layout", "checkpoints.checkpoint_trust: a layout the weights-only reader admits"),
    ("torch.distributed._symmetric_memory", "megatron_internals.parallel_linear: registers torch.ops.symm_mem"),
    ("torch.ops.mkldnn._is_mkldnn_fp16_supported", "torch_internals.onednn: whether this CPU runs fp16 for DeepSpeed"),
)


class UntestedTorch(RuntimeError):
    """The installed torch is not a tested release."""


def installed_version() -> str | None:
    """torch's version as its distribution records it ("2.13.0+cpu"), or None without torch."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get("torch"), "__version__", None)


def unresolved_private_calls() -> list[str]:
    """The entries of PRIVATE_CALLS that the installed torch lacks (imports torch)."""
    missing = []
    for path, _ in PRIVATE_CALLS:
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            missing.append(path)
    return missing


FENCE = VersionFence("torch", "torch", TESTED, OVERRIDE, "the private calls listed in gridwright.versions.torch_version",
                     "gridwright.versions.torch_version", lambda: installed_version(), UntestedTorch)
version_problem = FENCE.version_problem
refusal = FENCE.refusal
refuse_untested = FENCE.refuse_untested
