"""A `-m` sweep: one sweep directory with a record of every point, and one parent MLflow run.

`SweepCallback` is registered in conf/config.yaml (`hydra.callbacks`). Hydra's basic
launcher runs the points one after another in this process, so the callback opens the
sweep before the first point, places each point's job directory inside the sweep
directory (gridwright.runtime.jobdir), records each point in `sweep.json` as it ends, and at the
end writes the comparison (gridwright.tracking.sweep_report) and closes the parent run.

`sweep.json` is rewritten atomically after every point: the sweep's overrides, and per
point its number, overrides, job directory (relative to the sweep directory when inside
it), status (`finished`, `failed`, `invalid` with the one-line validation error,
`planned` when nothing ran here) and its stable id. With tracking off nothing touches
MLflow; `python -m gridwright.tracking.sync SWEEP_DIR` logs the directory later, the same way.
"""
from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import open_dict, read_write

from . import mlflow_runs as tracking
from ..atomic_io import write_text_atomic
from ..config.compose import strip_hydra
from ..runtime.jobdir import (JOB_FILE, SWEEP_FILE, JobDirExists, check_job_dir_free, create_sweep_dir, enter_sweep_point,
                     leave_sweep_point, planned_job_dir, read_json)
from ..planning.layout import ParallelLayout
from .sweep_report import name_suffix, override_key, point_label, swept_keys, write_report
from ..config.validation import ConfigError, validate

EXIT_INVALID = 2


def _now_ms() -> int:
    return int(time.time() * 1000)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass
class SweepRecord:
    """The content of sweep.json."""

    id: str
    name: str  # the parent run's name
    experiment: str
    overrides: list[str]
    tracking: dict  # the sweep's tracking config: enabled, uri, experiment
    started_ms: int
    ended_ms: int | None = None
    status: str = "running"  # running | finished
    points: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, sweep_dir: Path) -> "SweepRecord":
        return cls(**json.loads((Path(sweep_dir) / SWEEP_FILE).read_text()))

    def save(self, sweep_dir: Path) -> None:
        write_text_atomic(Path(sweep_dir) / SWEEP_FILE, json.dumps(asdict(self), indent=1))

    def job_dir_of(self, point: dict, sweep_dir: Path) -> Path | None:
        """The point's job directory (None for an invalid point, which has none)."""
        if not point.get("job_dir"):
            return None
        return Path(sweep_dir) / point["job_dir"]  # an absolute job_dir stays absolute


def _layout_names(cfg) -> tuple[str, str]:
    """(slug, description) of a point's layout; an invalid layout may divide by zero."""
    try:
        layout = ParallelLayout.from_config(cfg)
        return layout.slug(), layout.describe()
    except (ArithmeticError, ValueError, TypeError):
        return "invalid", "invalid layout"


def _why_invalid(cfg) -> str:
    """The one-line reason `run` refused a point (it printed it; the checks are cheap)."""
    try:
        validate(cfg, for_launch=True)
        check_job_dir_free(planned_job_dir(cfg))
    except (ConfigError, JobDirExists) as e:
        problems = getattr(e, "problems", None)
        return one_line("; ".join(problems) if problems else str(e))
    return f"exit code {EXIT_INVALID}"


class ActiveSweep:
    """The sweep running in this process: its directory, record and (tracking on) parent run."""

    def __init__(self, cfg, sweep_dir: Path, record: SweepRecord):
        self.dir, self.record = sweep_dir, record
        self.point_num: int | None = None  # the point running now
        self.point_overrides: list[str] = []
        self.point_started_ms = 0
        self.client = self.exp_id = self.parent_run_id = None
        if cfg.tracking.enabled:
            uri = tracking.tracking_uri(cfg)
            try:
                client = tracking.client_for(uri)
                self.exp_id = tracking.experiment_id(client, cfg.tracking.experiment, uri)
                self.parent_run_id, _ = tracking.sweep_run(client, self.exp_id, sweep_dir, record)
                self.client = client
            except Exception as e:  # noqa: BLE001 - the sweep's records still go to sweep.json
                print(f"error: MLflow at {uri} failed ({type(e).__name__}: {one_line(e)}); the sweep is "
                      f"recorded in {sweep_dir} only: log it later with python -m gridwright.tracking.sync",
                      file=sys.stderr)

    def run_tags(self) -> dict[str, str]:
        """Tags that nest a point's run under the sweep's run."""
        if self.parent_run_id is None or self.point_num is None:
            return {}
        return {tracking.PARENT_TAG: self.parent_run_id, tracking.SWEEP_POINT_TAG: str(self.point_num)}


_active: ActiveSweep | None = None


def run_name_suffix() -> str:
    """What the run of the point starting now adds to its name (gridwright.tracking.mlflow_runs.run_name)."""
    if _active is None:
        return ""
    return name_suffix(_active.record.overrides, _active.point_overrides)


def run_tags() -> dict[str, str]:
    """Tags for the MLflow run of the job starting now: nested under the sweep's run
    when it is a point of a tracked sweep; else none."""
    return _active.run_tags() if _active is not None else {}


def _point_record(sweep: ActiveSweep, config, job_return) -> dict:
    """What one finished point left: status, job directory, error."""
    cfg = strip_hydra(job_return.cfg)
    num = int(config.hydra.job.num)
    slug, layout = _layout_names(cfg)
    job_dir = planned_job_dir(cfg)
    job = read_json(job_dir / JOB_FILE)
    made_here = job.get("created_ms", -1) >= sweep.point_started_ms  # not an older job_dir= given
    value = job_return.return_value
    error = ""
    if isinstance(value, BaseException):
        status, error = "failed", one_line(f"{type(value).__name__}: {value}")
    elif value == 0:
        status = "finished" if cfg.launcher.name == "local" else "planned"
    elif value == EXIT_INVALID and not made_here:
        status, error = "invalid", _why_invalid(cfg)
    else:
        status, error = "failed", f"exit code {value}"
    overrides = [str(o) for o in config.hydra.overrides.task]
    point = {
        "num": num,
        "name": tracking.run_name(cfg, slug, name_suffix(sweep.record.overrides, overrides)),
        "slug": slug,
        "layout": layout,
        "overrides": overrides,
        "job_dir": None,
        "job_id": f"{sweep.record.id}-{num}",
        "status": status,
        "error": error,
        "started_ms": sweep.point_started_ms,
        "ended_ms": _now_ms(),
    }
    if made_here:
        inside = job_dir.parent == sweep.dir
        point["job_dir"] = job_dir.name if inside else str(job_dir)
        point["job_id"] = job["job_id"]
    return point


class SweepCallback(Callback):
    """Hydra callback: a sweep directory, sweep.json and a parent run for every `-m` sweep."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global _active
        cfg = strip_hydra(config)
        overrides = [str(o) for o in config.hydra.overrides.task]
        sweep_dir = create_sweep_dir(cfg)
        swept = swept_keys(overrides)
        varied = [o for o in overrides if override_key(o) in swept]
        record = SweepRecord(
            id=uuid.uuid4().hex, name=f"{cfg.name} sweep {' '.join(varied)}".strip()[:250],
            experiment=cfg.name, overrides=overrides,
            tracking={"enabled": bool(cfg.tracking.enabled), "uri": cfg.tracking.uri,
                      "experiment": cfg.tracking.experiment},
            started_ms=_now_ms(),
        )
        record.save(sweep_dir)
        # Hydra's own record of the sweep (multirun.yaml) goes into the sweep directory too.
        with read_write(config.hydra.sweep), open_dict(config.hydra.sweep):
            config.hydra.sweep.dir = str(sweep_dir)
        _active = ActiveSweep(cfg, sweep_dir, record)
        print(f"sweep dir   {sweep_dir}", flush=True)
        if _active.parent_run_id:
            print(f"mlflow      sweep run {_active.parent_run_id} in {tracking.tracking_uri(cfg)}", flush=True)

    def on_job_start(self, config, **kwargs) -> None:
        if _active is None:
            return
        _active.point_num = int(config.hydra.job.num)
        _active.point_overrides = [str(o) for o in config.hydra.overrides.task]
        _active.point_started_ms = _now_ms()
        enter_sweep_point(_active.dir, _active.point_num)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if _active is None:
            return
        try:
            point = _point_record(_active, config, job_return)
        finally:
            leave_sweep_point()
            _active.point_num = None
        _active.record.points.append(point)
        _active.record.save(_active.dir)
        if _active.client is not None:
            tracking.log_sweep_point(_active.client, _active.exp_id, _active.dir, _active.record, point,
                                     _active.parent_run_id)

    def on_multirun_end(self, config, **kwargs) -> None:
        global _active
        if _active is None:
            return
        sweep, _active = _active, None
        sweep.record.status, sweep.record.ended_ms = "finished", _now_ms()
        sweep.record.save(sweep.dir)
        report = write_report(sweep.dir, sweep.record)
        if sweep.client is not None:
            tracking.finish_sweep(sweep.client, sweep.parent_run_id, sweep.dir, sweep.record, report)
        print(f"sweep       {len(sweep.record.points)} points ({report.counts_text()}); "
              f"comparison in {sweep.dir / 'comparison.md'}", flush=True)
        if sweep.client is None:
            print(f"            log it to MLflow with: python -m gridwright.tracking.sync {sweep.dir}", flush=True)
        for point in sweep.record.points:
            print(f"  {point_label(point):<24} {point['status']:<9} {point['error'][:120]}", file=sys.stdout)
