"""Where the logging rank's step metrics go: one interface, one sink per destination.

The worker writes every step to each sink: `metrics.jsonl` in the job directory (the
record the summary, sync and sweeps read), the terminal, and the job's MLflow run
(gridwright.tracking.mlflow_runs.MetricsLogger, when the agent opened one). A restarted
job repeats the steps after its checkpoint exactly; each sink keeps a step once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from ..basics.atomic_io import write_text_atomic
from .jobdir import METRICS_FILE


class MetricsSink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics."""


class JsonlSink:
    """`metrics.jsonl`: what earlier attempts recorded before this attempt's first step is
    kept, and every step of this attempt is appended as it ends. `rows` is the file's
    content: the run's history, from which its summary is made."""

    def __init__(self, job_dir: Path, recorded_before: list[dict]):
        self.path = Path(job_dir) / METRICS_FILE
        self.recorded_before = recorded_before
        self.rows: list[dict] = []
        self.started = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.started:  # keep what earlier attempts recorded before this step
            self.started = True
            self.rows = [r for r in self.recorded_before if r["step"] < step]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        row = {"step": step, **metrics}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


class TerminalSink:
    """One line every `log_interval` steps, and one for the last step."""

    def __init__(self, log_interval: int, last_step: int, flops_definition: str):
        self.log_interval, self.last_step, self.flops_definition = log_interval, last_step, flops_definition

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.log_interval and step != self.last_step:
            return
        m = metrics
        extra = f" mfu {m['mfu']:.1%} ({self.flops_definition})" if "mfu" in m else ""
        extra += f" val_loss {m['val_loss']:.4f}" if "val_loss" in m else ""
        print(f"step {step:>5} loss {m['loss']:.4f} lr {m['lr']:.2e} {m['step_time_s'] * 1e3:.0f} ms "
              f"{m['tokens_per_s_per_gpu']:.0f} tok/s/gpu{extra}", flush=True)
