"""Throughput, MFU and memory of one training step (definitions in gridwright.planning.model_math).

`mfu` is always under the run's `evaluate.flops_definition` (default megatron); `mfu_palm`
beside it under the palm definition, so numbers compare with either school.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from ..basics.atomic_io import write_text_atomic
from .jobdir import RANKS_DIR
from .profiling import STEP_RANGE_PREFIX


def timed_step(train_step, step: int, on_cuda: bool) -> dict:
    """Run one training step and add its wall time (after the GPU has finished) as step_time_s."""
    if on_cuda:
        torch.cuda.synchronize()
    # The range marks, in a profiler trace, exactly the interval the timer measures.
    with torch.profiler.record_function(f"{STEP_RANGE_PREFIX}{step}"):
        start = time.perf_counter()
        metrics = train_step(step)
        if on_cuda:
            torch.cuda.synchronize()
        metrics["step_time_s"] = time.perf_counter() - start
    return metrics


def memory_peaks_gib(on_cuda: bool) -> dict[str, float]:
    """This process's peak memory so far: the CUDA allocator's on GPUs, the RSS on CPU."""
    if on_cuda:
        return {
            "memory_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "memory_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"memory_max_rss_gib": rss_kib * scale / 2**30}


def memory_record_path(job_dir, rank: int) -> Path:
    """Where each rank leaves its peak memory at the end of training."""
    return Path(job_dir) / RANKS_DIR / f"memory_{rank:05d}.json"


def write_memory_record(job_dir, rank: int, on_cuda: bool) -> None:
    """Leave this rank's peak memory for the logging rank's summary (every engine does)."""
    write_text_atomic(memory_record_path(job_dir, rank), json.dumps(memory_peaks_gib(on_cuda)))


def read_memory_records(job_dir) -> dict[int, dict]:
    """Every rank's peak-memory record, by rank."""
    return {int(p.stem.split("_")[1]): json.loads(p.read_text())
            for p in sorted((Path(job_dir) / RANKS_DIR).glob("memory_*.json"))}


# The keys of the plan's FLOPs record (model_math.flops_record), which a run's summary repeats.
FLOPS_KEYS = ("flops_definition", "flops_per_token", "hardware_flops_per_token", "peak_kind", "peak_tflops")


class StepMetrics:
    """Per-step metrics from the plan's record (plan.json): the FLOPs, peak and tokens
    every MFU number is computed from are the plan's own."""

    def __init__(self, plan: dict, world_size: int, on_cuda: bool):
        self.tokens_per_step = plan["tokens_per_step"]
        self.plan = plan
        self.world_size = world_size
        self.on_cuda = on_cuda
        self.record = {k: plan[k] for k in FLOPS_KEYS}
        self.peak_flops = self.record["peak_tflops"] * 1e12
        self.model_flops = self.record["flops_per_token"][self.record["flops_definition"]]
        self.palm_flops = self.record["flops_per_token"]["palm"]
        self.hardware_flops = self.record["hardware_flops_per_token"]

    def memory_gib(self) -> dict[str, float]:
        return memory_peaks_gib(self.on_cuda)

    def _flops(self, raw: dict) -> tuple[float, float, float]:
        """(model, PaLM, hardware) FLOPs per token of this step: the plan's, or with packed
        documents those of the step's mean context (`attention_context`)."""
        context = raw.get("attention_context")
        per_context = self.plan.get("flops_per_context_token")
        if context is None or not per_context:
            return self.model_flops, self.palm_flops, self.hardware_flops
        fewer = self.plan["seq_length"] - context
        return (self.model_flops - per_context[self.record["flops_definition"]] * fewer,
                self.palm_flops - per_context["palm"] * fewer,
                self.hardware_flops - self.plan["hardware_flops_per_context_token"] * fewer)

    def derive(self, raw: dict[str, float]) -> dict[str, float]:
        out = dict(raw)
        tps = self.tokens_per_step / raw["step_time_s"]
        out["tokens_per_s"] = tps
        out["tokens_per_s_per_gpu"] = tps / self.world_size
        per_gpu = out["tokens_per_s_per_gpu"]
        model_flops, palm_flops, hardware_flops = self._flops(raw)
        out["tflops_per_gpu"] = per_gpu * model_flops / 1e12
        if self.peak_flops > 0:  # unknown peak (CPU): no MFU rather than a made-up one
            out["mfu"] = per_gpu * model_flops / self.peak_flops
            out["mfu_palm"] = per_gpu * palm_flops / self.peak_flops
            out["hfu"] = per_gpu * hardware_flops / self.peak_flops
        out.update(self.memory_gib())
        return out
