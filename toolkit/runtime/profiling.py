"""The opt-in profiling window: torch.profiler traces of chosen steps, on every rank.

`evaluate.profile_steps=[first, last)` traces those steps; each rank writes
`traces/rank_NNNNN.json.gz` (Chrome trace format, gzip) into the job directory, where
`gridwright.analysis.trace_analysis` reads them. The profiler is started and stopped by hand
rather than through its wait/warmup/active schedule, so that the traced steps are
exactly the ones named, and every step is marked by a `gridwright_step_N` range (the
interval the step timer measures, `step_metrics.timed_step`), which the analysis takes
as the step's window.

libkineto writes a `USDT: ... profiler_start` / `profiler_stop` line to the terminal at
every start and stop, which torch does not silence; the two calls run under
`known_warnings.native_stderr_filtered`, which drops those lines and lets the rest of
what kineto says (its errors) through.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

from ..basics.atomic_io import write_text_atomic
from ..basics.known_warnings import native_stderr_filtered

TRACES_DIR = "traces"
STEP_RANGE_PREFIX = "gridwright_step_"


def trace_path(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / TRACES_DIR / f"rank_{rank:05d}.json.gz"


def step_times_path(job_dir: Path, rank: int) -> Path:
    """The step timer's seconds for the traced steps of one rank (to check the trace against)."""
    return Path(job_dir) / TRACES_DIR / f"rank_{rank:05d}.steps.json"


class ProfileWindow:
    """Starts torch.profiler before the window's first step and writes the trace after its last."""

    def __init__(self, evaluate, cluster, job_dir, rank: int):
        window = evaluate.profile_steps
        self.first, self.last = (int(window[0]), int(window[1])) if window else (None, None)
        self.on_cuda = cluster.device == "cuda"
        self.job_dir, self.rank = Path(job_dir), rank
        self.profiler = None
        self.timer: dict[int, float] = {}

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        import torch  # here, so that readers of the trace files' names need no torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        with native_stderr_filtered():
            self.profiler.start()

    def writes_after(self, step: int) -> bool:
        """Whether after_step(step) writes the trace (it ends the window)."""
        return self.profiler is not None and step == self.last - 1

    def after_step(self, step: int, step_time_s: float) -> None:
        if self.profiler is None:
            return
        self.timer[step] = step_time_s
        if step != self.last - 1:
            return
        with native_stderr_filtered():
            self.profiler.stop()
        out = trace_path(self.job_dir, self.rank)
        out.parent.mkdir(parents=True, exist_ok=True)
        raw = out.with_name(f".{out.name}.{os.getpid()}.json")
        self.profiler.export_chrome_trace(str(raw))
        partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
        with open(raw, "rb") as src, gzip.open(partial, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        os.replace(partial, out)  # readers never see a half-written trace
        raw.unlink()
        write_text_atomic(step_times_path(self.job_dir, self.rank), json.dumps(self.timer))
        self.profiler = None
