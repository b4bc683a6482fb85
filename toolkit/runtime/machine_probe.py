"""What this machine can run: CUDA devices and Transformer Engine, asked of a fresh Python.

A local launch is refused before anything starts when the cluster names GPUs this
machine does not have, FP8 where neither Transformer Engine nor torchao can run it, or
DeepSpeed fp16 on a CPU without fp16 support. Importing
torch takes seconds, so the question goes to a child process: composing, validating and
planning never import torch themselves, and the probe runs only for local GPU launches.
The host's memory (`host_memory_bytes`, for local CPU launches) needs no torch and is read here.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass

def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports here. It needs CUDA and cuDNN: without them its
    import fails, and Megatron-Core would silently drop FP8 (which validation refuses)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # an install without CUDA/cuDNN fails at import
        return False
    return True


def _facts_here(with_transformer_engine: bool) -> dict:
    """What this process finds; run in the child (`python -m gridwright.runtime.machine_probe`)."""
    out = {"torch": None, "cuda_devices": 0, "transformer_engine": False, "error": None, "cpu_fp16": False}
    try:
        import torch

        from ..torch_internals.onednn import cpu_fp16_supported

        out["torch"] = torch.__version__
        out["cuda_devices"] = torch.cuda.device_count()
        out["cpu_fp16"] = cpu_fp16_supported()
    except Exception as e:  # noqa: BLE001 - reported, not raised: the parent words the refusal
        out["error"] = f"{type(e).__name__}: {e}"
    if with_transformer_engine:
        out["transformer_engine"] = transformer_engine_available()
    return out


def host_memory_bytes() -> int:
    """The memory a run's processes on this machine can use: the smaller of the RAM psutil
    reports and the container's cgroup limit (inside a container psutil sees the host's RAM)."""
    import psutil

    limits = [psutil.virtual_memory().total]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit
            limits.append(int(text))
    return min(limits)


PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class MachineFacts:
    torch: str | None
    cuda_devices: int
    transformer_engine: bool
    error: str | None
    cpu_fp16: bool = False


@functools.lru_cache(maxsize=2)
def probe(transformer_engine: bool = False) -> MachineFacts:
    """Ask a child Python (this interpreter) what it finds; cached for this process.
    Transformer Engine is imported only when asked (FP8 runs): its import can be slow."""
    try:
        done = subprocess.run([sys.executable, "-m", "gridwright.runtime.machine_probe", "te" if transformer_engine else "-"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return MachineFacts(None, 0, False, f"importing torch took over {PROBE_TIMEOUT_S} s")
    try:
        return MachineFacts(**json.loads(done.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        return MachineFacts(None, 0, False, f"the probe failed: {done.stderr.strip()[-300:]}")


if __name__ == "__main__":
    from gridwright.basics.process_exit import exit_without_final_collection

    print(json.dumps(_facts_here(sys.argv[1:] == ["te"])))
    exit_without_final_collection()
