"""Megatron-Core 0.16.1 on CPU: every workaround in one place, active only for CPU runs.

Megatron-Core hard-codes CUDA in places no config flag reaches. Rather than patch its
source, a CPU run enters `cpu_compat()`, which:

1. installs a torch function mode that turns tensor requests for a CUDA device into CPU
   ones, and answers `Tensor.type()` with the CUDA type name Megatron's checks expect:
   - pipeline_parallel/schedules.py:596, 983, 2138   torch.zeros(..., device="cuda")
   - optimizer/optimizer.py:473-485, 907             torch.tensor(..., device='cuda')
   - optimizer/clip_grads.py:90-207                  device='cuda' and a
                                                      `grad.type() == 'torch.cuda.FloatTensor'` assert
   - optimizer/distrib_optimizer.py:420-437          `model_param.type()` must name a CUDA type
   - optimizer/grad_scaler.py:15-94                  device='cuda' (fp16 loss scaling)
   - distributed/param_and_grad_buffer.py:768-806    device="cuda" / current_device()
   - models/common/embeddings/rope_utils.py:62       torch.tensor(..., pin_memory=True) (CP)
2. replaces a few `torch.cuda` functions that raise without CUDA:
   - `torch.cuda.current_device` -> the CPU device (core/utils.py:631 GlobalMemoryBuffer,
     transformer/moe/router.py:90, p2p_communication.py:190-321, distrib_optimizer.py:791)
   - `torch.cuda.synchronize` -> no-op (p2p_communication.py:242, 398)
   - `torch.cuda.Stream`, `torch.cuda.stream` -> inert stand-ins
     (distributed/distributed_data_parallel.py:230 communication stream)
Bugs that appear without Transformer Engine on any device are fixed in `megatron_fixes`.

3. makes activation recompute save and restore the CPU generator instead of the CUDA one
   (tensor_parallel/random.py:55 `_get_cuda_rng_state`, :72 `_set_cuda_rng_state`, used by
   CheckpointFunction for `train.recompute=full`).

RNG: `model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)` avoids
`torch.cuda.get_rng_state` (tensor_parallel/random.py); dropout then draws from the CPU
generator, without TP decorrelation. The engine calls it that way on CPU.

`tests/test_megatron_internals.py` checks that this module stays small and that every
line in CITED is still in the installed Megatron-Core.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
CPU = torch.device("cpu")

CITED = [
    ("pipeline_parallel/schedules.py", 'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("optimizer/optimizer.py", "self.found_inf = torch.tensor([0.0], dtype=torch.float, device='cuda')"),
    ("optimizer/clip_grads.py", "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    ("optimizer/distrib_optimizer.py", "elif model_param.type() == 'torch.cuda.FloatTensor':"),
    ("utils.py", "device=torch.cuda.current_device(),"),
    ("transformer/moe/router.py", "self.weight.data.to(device=torch.cuda.current_device())"),
    ("pipeline_parallel/p2p_communication.py", "torch.cuda.synchronize()"),
    ("distributed/distributed_data_parallel.py", "torch.cuda.Stream(device=torch.cuda.current_device())"),
    ("models/common/embeddings/rope_utils.py", "pin_memory=True"),
    ("tensor_parallel/random.py", "return torch.cuda.random.get_rng_state(device=device)"),
]


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal
    return str(device).startswith("cuda")


class CudaAsCpuMode(TorchFunctionMode):
    """Redirects CUDA device arguments to the CPU and names CPU tensors as CUDA types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinned memory needs an accelerator
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


class _InertStream:
    """Stands in for torch.cuda.Stream: on CPU all work is already in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return None


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(state, *args, **kwargs):
    torch.set_rng_state(state)


@contextlib.contextmanager
def cpu_compat():
    """Run Megatron-Core on CPU inside this context (see the module docstring)."""
    from megatron.core.tensor_parallel import random as mcore_random

    saved_rng = (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state)
    mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state = _cpu_rng_state, _set_cpu_rng_state
    saved = {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "Stream": torch.cuda.Stream,
        "stream": torch.cuda.stream,
    }
    torch.cuda.current_device = lambda: CPU
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _InertStream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    try:
        with CudaAsCpuMode():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state = saved_rng
