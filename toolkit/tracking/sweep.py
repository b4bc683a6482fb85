"""A `-m` sweep: one sweep directory with a record of every point, and one parent MLflow run.

`SweepCallback` is registered in conf/config.yaml (`hydra.callbacks`). Hydra's basic
launcher runs the points one after another in this process: the callback opens the
sweep before the first point, records each point in `sweep.json` from the Outcome its
launch returned, and at the end writes the comparison (gridwright.tracking.sweep_report)
and closes the parent run. The point itself learns its sweep (`sweep_context`: where its
job directory goes, how its run nests) from Hydra's per-point config, whose
`hydra.sweep.dir` the callback sets, and from `sweep.json`; nothing passes through
module state.

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
from ..basics.atomic_io import write_text_atomic
from ..config.compose import strip_hydra
from ..runtime.jobdir import JOB_FILE, SWEEP_FILE, SweepPoint, create_sweep_dir, planned_job_dir, read_json
from ..runtime.outcome import Outcome
from ..planning.layout import ParallelLayout
from .sweep_report import name_suffix, override_key, swept_keys, write_report


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
    parent_run_id: str | None = None  # the sweep's MLflow run, when tracking reached it

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


class ActiveSweep:
    """The sweep running in this process: its directory, record and (tracking on) parent run."""

    def __init__(self, tracking_cfg, sweep_dir: Path, record: SweepRecord):
        self.dir, self.record = sweep_dir, record
        self.uri = tracking.tracking_uri(tracking_cfg)
        self.point_started_ms = 0  # when the point running now started
        self.client = self.exp_id = self.parent_run_id = None
        if tracking_cfg.enabled:
            uri = tracking.tracking_uri(tracking_cfg)
            try:
                client = tracking.client_for(uri)
                self.exp_id = tracking.experiment_id(client, tracking_cfg.experiment, uri)
                self.parent_run_id, _ = tracking.sweep_run(client, self.exp_id, sweep_dir, record)
                self.client = client
            except Exception as e:  # noqa: BLE001 - the sweep's records still go to sweep.json
                print(f"error: MLflow at {uri} failed ({type(e).__name__}: {one_line(e)}); the sweep is "
                      f"recorded in {sweep_dir} only: log it later with python -m gridwright.tracking.sync",
                      file=sys.stderr)


@dataclass(frozen=True)
class SweepContext:
    """What the point running now takes from its sweep."""

    job_point: SweepPoint  # its job directory goes inside the sweep's directory
    run_tags: dict[str, str]  # nest its MLflow run under the sweep's run (none without one)
    name_suffix: str  # what its run's name adds: the values this point sweeps


def sweep_context() -> SweepContext:
    """The context of the sweep point this process runs now (call it from the point's
    task function), from Hydra's per-point config and the sweep's record."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    sweep_dir, num = Path(hydra.sweep.dir), int(hydra.job.num)
    record = SweepRecord.load(sweep_dir)
    tags = {tracking.PARENT_TAG: record.parent_run_id, tracking.SWEEP_POINT_TAG: str(num)} if record.parent_run_id else {}
    return SweepContext(SweepPoint(sweep_dir, num), tags,
                        name_suffix(record.overrides, [str(o) for o in hydra.overrides.task]))


def _hydra_quoted(value: str) -> str:
    """A value as a quoted Hydra override value (any path survives the override grammar)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _point_record(sweep: ActiveSweep, config, job_return) -> dict:
    """What one finished point left: status, job directory, error, from the Outcome its
    launch returned (or the exception it raised)."""
    cfg = strip_hydra(job_return.cfg)
    num = int(config.hydra.job.num)
    slug, layout = _layout_names(cfg)
    value = job_return.return_value
    error = ""
    if isinstance(value, BaseException):
        status, error = "failed", one_line(f"{type(value).__name__}: {value}")
    elif not isinstance(value, Outcome):
        status, error = "failed", f"the point returned {value!r}"
    elif value.status == "invalid":
        status, error = "invalid", one_line("; ".join(value.problems))
    elif value.exit_code == 0:
        status = "finished" if cfg.launcher.name == "local" else "planned"
    else:
        status, error = "failed", f"exit code {value.exit_code}"
    job_dir = value.job_dir if isinstance(value, Outcome) and value.job_dir else None
    if job_dir is None and status != "invalid":  # a crash may have left one
        job_dir = planned_job_dir(cfg, SweepPoint(sweep.dir, num))
    job = read_json(job_dir / JOB_FILE) if job_dir is not None else {}
    made_here = job.get("created_ms", -1) >= sweep.point_started_ms  # not an older job_dir= given
    overrides = [str(o) for o in config.hydra.overrides.task]
    point = {
        "num": num,
        "name": tracking.run_name(cfg.name, slug, name_suffix(sweep.record.overrides, overrides)),
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
    """Hydra callback: a sweep directory, sweep.json and a parent run for every `-m` sweep.
    Hydra makes one per process; it keeps the sweep running in it."""

    def __init__(self) -> None:
        self.sweep: ActiveSweep | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        cfg = strip_hydra(config)
        overrides = [str(o) for o in config.hydra.overrides.task]
        sweep_dir = create_sweep_dir(cfg.job_root, cfg.name)
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
        # Hydra's record of the sweep (multirun.yaml) goes into the sweep directory, and every
        # point's config is composed with hydra.sweep.dir naming it (Hydra recomposes each
        # point from the sweep's hydra overrides): that is how a point finds its sweep.
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = str(sweep_dir)
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={_hydra_quoted(str(sweep_dir))}")
        self.sweep = ActiveSweep(cfg.tracking, sweep_dir, record)
        record.parent_run_id = self.sweep.parent_run_id
        record.save(sweep_dir)
        print(f"sweep dir   {sweep_dir}", flush=True)
        if self.sweep.parent_run_id:
            print(f"mlflow      sweep run {self.sweep.parent_run_id} in {tracking.tracking_uri(cfg.tracking)}", flush=True)

    def on_job_start(self, config, **kwargs) -> None:
        if self.sweep is not None:
            self.sweep.point_started_ms = _now_ms()
            swept = swept_keys(self.sweep.record.overrides)
            varied = [str(o) for o in config.hydra.overrides.task if override_key(str(o)) in swept]
            print(f"point       #{config.hydra.job.num}: {' '.join(varied)}", flush=True)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        sweep = self.sweep
        if sweep is None:
            return
        point = _point_record(sweep, config, job_return)
        sweep.record.points.append(point)
        sweep.record.save(sweep.dir)
        if sweep.client is not None:
            tracking.log_sweep_point(sweep.client, sweep.exp_id, sweep.dir, sweep.record, point, sweep.parent_run_id)

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep, self.sweep = self.sweep, None
        if sweep is None:
            return
        sweep.record.status, sweep.record.ended_ms = "finished", _now_ms()
        sweep.record.save(sweep.dir)
        report = write_report(sweep.dir, sweep.record)
        if sweep.client is not None:
            tracking.finish_sweep(sweep.client, sweep.parent_run_id, sweep.dir, sweep.record, report)
        print(f"sweep       {len(sweep.record.points)} points ({report.counts_text()}); "
              f"comparison in {sweep.dir / 'comparison.md'}", flush=True)
        print("\n".join(report.terminal_lines()), flush=True)
        if sweep.client is None:
            print(f"            log it to MLflow with: python -m gridwright.tracking.sync {sweep.dir}", flush=True)
        else:
            print(f"mlflow      sweep run {sweep.parent_run_id}", flush=True)
            print("\n".join(tracking.sweep_links(sweep.uri, sweep.parent_run_id)),
                  flush=True)
