"""What this machine can run: CUDA devices and Transformer Engine, asked of a fresh Python.

A local launch is refused before anything starts when the cluster names GPUs this
machine does not have, or FP8 where Transformer Engine cannot be imported. Importing
torch takes seconds, so the question goes to a child process: composing, validating and
planning never import torch themselves, and the probe runs only for local GPU launches.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass

_PROBE = """
import importlib.util, json, sys
out = {"torch": None, "cuda_devices": 0, "transformer_engine": False, "error": None}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda_devices"] = torch.cuda.device_count()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
if sys.argv[1] == "te" and importlib.util.find_spec("transformer_engine") is not None:
    try:
        import transformer_engine.pytorch  # needs CUDA and cuDNN; fails at import without them
        out["transformer_engine"] = True
    except Exception:
        pass
print(json.dumps(out))
"""
PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class MachineFacts:
    torch: str | None
    cuda_devices: int
    transformer_engine: bool
    error: str | None


@functools.lru_cache(maxsize=2)
def probe(transformer_engine: bool = False) -> MachineFacts:
    """Ask a child Python (this interpreter) what it finds; cached for this process.
    Transformer Engine is imported only when asked (FP8 runs): its import can be slow."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, "te" if transformer_engine else "-"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return MachineFacts(None, 0, False, f"importing torch took over {PROBE_TIMEOUT_S} s")
    try:
        return MachineFacts(**json.loads(done.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        return MachineFacts(None, 0, False, f"the probe failed: {done.stderr.strip()[-300:]}")
