"""Throughput, MFU and memory of one training step (definitions in gridwright.model_math)."""
from __future__ import annotations

import resource
import sys
import time

import torch

from .model_math import hardware_flops_per_token, model_flops_per_token


def timed_step(train_step, step: int, on_cuda: bool) -> dict:
    """Run one training step and add its wall time (after the GPU has finished) as step_time_s."""
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = train_step(step)
    if on_cuda:
        torch.cuda.synchronize()
    metrics["step_time_s"] = time.perf_counter() - start
    return metrics


class StepMetrics:
    def __init__(self, cfg, world_size: int):
        t = cfg.train
        self.tokens_per_step = t.global_batch_size * t.seq_length
        self.world_size = world_size
        self.on_cuda = cfg.cluster.device == "cuda"
        fp8 = cfg.precision.fp8_recipe is not None
        peak = cfg.cluster.gpu.peak_fp8_tflops if fp8 else cfg.cluster.gpu.peak_bf16_tflops
        self.peak_flops = peak * 1e12
        self.model_flops = model_flops_per_token(cfg.model, t.seq_length)
        self.hardware_flops = hardware_flops_per_token(cfg.model, t.seq_length, t.recompute)

    def memory_gib(self) -> dict[str, float]:
        if self.on_cuda:
            return {
                "memory_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "memory_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            }
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return {"memory_max_rss_gib": rss_kib * scale / 2**30}

    def derive(self, raw: dict[str, float]) -> dict[str, float]:
        out = dict(raw)
        tps = self.tokens_per_step / raw["step_time_s"]
        out["tokens_per_s"] = tps
        out["tokens_per_s_per_gpu"] = tps / self.world_size
        if self.peak_flops > 0:
            out["mfu"] = out["tokens_per_s_per_gpu"] * self.model_flops / self.peak_flops
            out["hfu"] = out["tokens_per_s_per_gpu"] * self.hardware_flops / self.peak_flops
        out.update(self.memory_gib())
        return out
