"""MLflow: every run is an MLflow run, in a local SQLite store unless told otherwise.

One owner for what a job's run holds (`job_params`, `job_tags`) and for logging a job
directory's files (`log_job_results`), used both live and afterwards:

* live: the launching process opens the run (`open_run`: params, tags, config, placement
  and plan artifacts) and hands its id to the workers through MLFLOW_RUN_ID; the one
  logging rank adds per-step metrics; `close_run` logs the results from the job directory.
  Jobs emitted for Slurm or multi-node torchrun have no launching process on the cluster,
  so there the logging rank opens the run itself.
* afterwards: `log_job_dir` and `log_sweep` log job and sweep directories written without
  MLflow (`python -m gridwright.tracking.sync`), found again by their stable ids, so twice is once.

A `-m` sweep is one parent run with a nested run per point (tag `mlflow.parentRunId`).
"""
from __future__ import annotations

import contextlib
import fcntl
import subprocess
import time
from pathlib import Path

from omegaconf import OmegaConf

from ..runtime.jobdir import (ADVICE_FILE, CONFIG_FILE, METRICS_FILE, PLACEMENT_CSV, PLACEMENT_JSON, PLAN_FILE, RANKS_DIR,
                              RUN_NAME_SUFFIX_KEY, RUN_TAGS_KEY, SUMMARY_FILE, job_record, load_job_config, read_json,
                              read_metrics)
from ..planning.layout import ParallelLayout
from ..runtime.profiling import TRACES_DIR
from . import run_owner
from . import headline, runs_view
from .sweep_report import COMM_PROFILE_PNG, POINTS_PNG, SweepReport, name_suffix, override_key, write_report
from ..analysis.trace_analysis import COMMUNICATION_FILE
from .store import bound_http_waits, tracking_uri

REPO_ROOT = Path(__file__).resolve().parents[2]

# The experiment's kind for MLflow 3's UI; the printed links also say so (runs_view).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
PARENT_TAG = "mlflow.parentRunId"
JOB_ID_TAG = "gridwright.job_id"
SWEEP_ID_TAG = "gridwright.sweep_id"
SWEEP_POINT_TAG = "gridwright.sweep_point"
STATUS_TAG = "gridwright.status"  # finished | failed | killed | invalid | planned
ERROR_TAG = "gridwright.error"
MLFLOW_STATUS = {"finished": "FINISHED", "planned": "FINISHED", "failed": "FAILED", "invalid": "FAILED",
                 "killed": "KILLED"}

SETUP_FILES = (CONFIG_FILE, PLACEMENT_JSON, PLACEMENT_CSV, PLAN_FILE)
RESULT_FILES = (SUMMARY_FILE, METRICS_FILE, COMMUNICATION_FILE, COMM_PROFILE_PNG)
MAX_PARAM_CHARS = 6000


# Store and experiment -------------------------------------------------------
def _artifact_location(uri: str) -> str | None:
    """Keep artifacts beside a local SQLite store, not in whatever directory a worker runs in."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    return None


@contextlib.contextmanager
def _store_setup_lock(uri: str):
    """One process at a time sets up a local SQLite store (MLflow's schema migration) and
    creates experiments in it: two first runs at once otherwise race (alembic, UNIQUE)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".setup-lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def client_for(uri: str):
    """A client of the store at `uri`; a new local store is set up (MLflow's schema
    migration) by one process at a time."""
    from mlflow.tracking import MlflowClient

    bound_http_waits()
    quiet_store_errors()
    with _store_setup_lock(uri):
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # sets the store up now, inside the lock
    return client


def experiment_id(client, name: str, uri: str) -> str:
    """The experiment's id, created if needed, tagged so that the UI opens it on its runs."""
    with _store_setup_lock(uri):
        return _experiment_id(client, name, uri)


def _experiment_id(client, name: str, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            exp_id = client.create_experiment(name, artifact_location=_artifact_location(uri), tags=EXPERIMENT_TAGS)
            runs_view.publish(client, exp_id, runs_view.RUNS_VIEW, runs_view.view_state())
            return exp_id
        except MlflowException:  # created meanwhile by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    for key, value in EXPERIMENT_TAGS.items():
        if exp.tags.get(key) != value:
            client.set_experiment_tag(exp.experiment_id, key, value)
    runs_view.publish(client, exp.experiment_id, runs_view.RUNS_VIEW, runs_view.view_state())
    return exp.experiment_id


def find_run(client, exp_id: str, tag: str, value: str):
    """The (not deleted) run of this experiment whose `tag` is `value`, or None."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1)
    return runs[0] if runs else None


# What a job's run holds ----------------------------------------------------
def flatten(cfg) -> dict[str, str]:
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out


def _number(x: float):
    return int(x) if float(x).is_integer() else round(x, 6)


def derived_params(train, layout: ParallelLayout) -> dict[str, str]:
    """Degrees and batch arithmetic that the config implies; those an invalid layout leaves
    undefined (a zero divisor) are left out."""
    out = {"derived.world_size": layout.world_size}
    if layout.model_parallel_size > 0:
        out["derived.dp"] = layout.dp
        if layout.dp > 0 and train.micro_batch_size > 0:
            out["derived.accumulation"] = _number(
                train.global_batch_size / (train.micro_batch_size * layout.dp))
    if layout.expert_model_parallel_size > 0:
        out["derived.expert_dp"] = layout.expert_dp
    return {k: str(v) for k, v in out.items()}


def plan_params(job_dir: Path | None) -> dict[str, str]:
    """FLOPs, peak and memory estimate from the job's plan.json; {} without one."""
    plan = read_json(Path(job_dir) / PLAN_FILE) if job_dir is not None else {}
    flops = plan.get("flops_per_token") if isinstance(plan.get("flops_per_token"), dict) else {}
    out = {
        "flops.definition": plan.get("flops_definition"),
        "flops.per_token_megatron": flops.get("megatron"),
        "flops.per_token_palm": flops.get("palm"),
        "flops.peak_tflops": plan.get("peak_tflops"),
        "flops.peak_kind": plan.get("peak_kind"),
        "memory.estimate_gib": plan.get("memory_estimate_gib"),
    }
    predicted = plan.get("predicted_step") if isinstance(plan.get("predicted_step"), dict) else {}
    for key, name, digits in (("tokens_per_s_per_gpu", "tokens_per_s_per_gpu", 0), ("mfu", "mfu", 4),
                              ("step_s", "step_s", 4)):
        if predicted.get(key) is not None:  # the step-time model's, beside what the run measures
            out[f"predicted.{name}"] = round(predicted[key], digits)
    return {k: str(v) for k, v in out.items() if v is not None}


def job_params(cfg, layout: ParallelLayout, job_dir: Path | None = None) -> dict[str, str]:
    """The params of a job's run: the flattened config, derived degrees, and the plan."""
    return {**flatten(cfg), **derived_params(cfg.train, layout), **plan_params(job_dir)}


def run_name(name: str, slug: str, suffix: str = "") -> str:
    """`<experiment> <layout slug>`, e.g. `llama3_8b tp2-sp-dp4`; a sweep that varies more
    than the layout adds the point's values (`tiny_llama dp2 train.lr=1e-3`)."""
    return f"{name} {slug}" + (f" {suffix}" if suffix else "")


def unique_run_name(client, exp_id: str, name: str) -> str:
    """`name`, or `name #N` with the next free N: repeated runs of one experiment and
    layout stay apart in the runs table and still say the layout."""
    from mlflow.entities import ViewType

    like = "" if "'" in name else f"attributes.run_name LIKE '{name}%'"  # a quote: look at every run
    taken = {r.info.run_name for r in client.search_runs(
        [exp_id], filter_string=like, run_view_type=ViewType.ALL, max_results=50000)}
    if name not in taken:
        return name
    n = 2
    while f"{name} #{n}" in taken:
        n += 1
    return f"{name} #{n}"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def job_tags(cfg, layout: ParallelLayout, job_dir: Path) -> dict[str, str]:
    return {
        "gridwright.experiment": cfg.name,
        "gridwright.engine": cfg.engine.name,
        "gridwright.layout": layout.describe(),
        "gridwright.world_size": str(layout.world_size),
        "gridwright.cluster": cfg.cluster.name,
        "gridwright.gpu": cfg.cluster.gpu.name,
        "gridwright.launcher": cfg.launcher.name,
        "gridwright.job_dir": str(job_dir),
        JOB_ID_TAG: job_record(job_dir)["job_id"],
        "mlflow.source.git.commit": git_commit(),
    }


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    batch = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i:i + 100])


def _log_metrics(client, run_id: str, metrics) -> None:
    batch = list(metrics)
    for i in range(0, len(batch), 1000):
        client.log_batch(run_id, metrics=batch[i:i + 1000])


def create_job_run(client, exp_id: str, cfg, layout: ParallelLayout, job_dir: Path, *,
                   tags: dict | None = None, start_time: int | None = None, name_suffix: str = "") -> str:
    """A new run for the job in `job_dir`: name, tags, params and the planning artifacts."""
    name = unique_run_name(client, exp_id, run_name(cfg.name, layout.slug(), name_suffix))
    run = client.create_run(exp_id, start_time=start_time, run_name=name,
                            tags={**job_tags(cfg, layout, job_dir), **(tags or {})})
    run_id = run.info.run_id
    _log_params(client, run_id, job_params(cfg, layout, job_dir))
    for name in SETUP_FILES:
        if (job_dir / name).is_file():
            client.log_artifact(run_id, str(job_dir / name))
    return run_id


# A job directory's results ---------------------------------------------------
def _step_metrics(job_dir: Path, start_ms: int):
    """metrics.jsonl's curves (headline.step_metrics) as MLflow metrics; each step timed by
    the step times before it."""
    from mlflow.entities import Metric

    out, clock = [], float(start_ms)
    for row in read_metrics(job_dir):
        clock += 1000 * float(row.get("step_time_s") or 0)
        out += [Metric(k, v, int(clock), int(row["step"])) for k, v in headline.step_metrics(row).items()]
    return out


def ended_ms(job_dir: Path, known: int | None = None) -> int | None:
    """When the job ended, from its own records: `known` (a sweep's record of the point),
    else the summary's end, else its start plus the step times it recorded. Never the
    files' times: a copied or cloned job directory has new ones."""
    if known:
        return int(known)
    summary = read_json(Path(job_dir) / SUMMARY_FILE)
    if isinstance(summary.get("ended_ms"), (int, float)):
        return int(summary["ended_ms"])
    start = job_record(Path(job_dir)).get("created_ms")
    rows = read_metrics(Path(job_dir))
    if start is None or not rows:
        return None
    return int(start + 1000 * sum(float(r.get("step_time_s") or 0) for r in rows))


def job_outcome(launcher, job_dir: Path) -> str:
    """What a job directory shows: finished (it left a summary), killed (its summary says
    a signal stopped it), planned (nothing has run: a plan, or a torchrun/Slurm job not
    run yet), else failed."""
    summary = read_json(job_dir / SUMMARY_FILE)
    if summary:
        return "killed" if summary.get("stopped_by_signal") else "finished"
    ran = (job_dir / METRICS_FILE).is_file() or (job_dir / RANKS_DIR).is_dir()
    return "planned" if not ran and launcher.name != "local" else "failed"


def log_job_results(client, run_id: str, job_dir: Path, *, step_metrics: bool) -> None:
    """What a run left in its job directory: the summary's headline metrics (the rest stays in
    summary.json), the result files and traces as artifacts, and (when not logged live) the
    curves of metrics.jsonl."""
    from mlflow.entities import Metric

    job_dir = Path(job_dir)
    if step_metrics:
        _log_metrics(client, run_id, _step_metrics(job_dir, job_record(job_dir)["created_ms"]))
    summary = read_json(job_dir / SUMMARY_FILE)
    if summary:
        stamp, step = ended_ms(job_dir) or int(time.time() * 1000), 0
        values = headline.run_metrics(summary, read_json(job_dir / PLAN_FILE))
        _log_metrics(client, run_id, [Metric(k, v, stamp, step) for k, v in values.items()])
    for name in RESULT_FILES:
        if (job_dir / name).is_file():
            client.log_artifact(run_id, str(job_dir / name))
    if (job_dir / TRACES_DIR).is_dir():
        client.log_artifacts(run_id, str(job_dir / TRACES_DIR), artifact_path=TRACES_DIR)


def log_job_dir(client, exp_id: str, job_dir: Path, *, status: str | None = None,
                tags: dict | None = None, name_suffix: str = "", end_ms: int | None = None) -> tuple[str, bool]:
    """Log a job directory as one run unless a run with its job id exists already; a run
    logged as planned whose job has run since (torchrun/Slurm) gets the results. `status`
    (from a sweep's record) is taken unless the files show the planned job has run.
    Returns (run id, whether anything was logged now)."""
    job_dir = Path(job_dir).resolve()
    record = job_record(job_dir)
    cfg = load_job_config(job_dir)
    outcome = job_outcome(cfg.launcher, job_dir)
    status = outcome if status in (None, "planned") else status
    existing = find_run(client, exp_id, JOB_ID_TAG, record["job_id"])
    if existing is not None and existing.info.status == "RUNNING":
        close_orphaned_run(cfg.tracking, cfg.launcher, job_dir, status="killed")
    if existing is not None:
        if existing.data.tags.get(STATUS_TAG) != "planned" or status == "planned":
            return existing.info.run_id, False
        run_id = existing.info.run_id
    else:
        run_id = create_job_run(client, exp_id, cfg, ParallelLayout.from_config(cfg), job_dir,
                                start_time=record.get("created_ms"), tags=tags, name_suffix=name_suffix)
    log_job_results(client, run_id, job_dir, step_metrics=True)
    client.set_tag(run_id, STATUS_TAG, status)
    end, start = ended_ms(job_dir, end_ms), record.get("created_ms")
    client.set_terminated(run_id, status=MLFLOW_STATUS[status], end_time=max(end, start) if end and start else end)
    return run_id, True


# Live runs -----------------------------------------------------------------
def open_run(cfg, job_dir: Path) -> str:
    """The MLflow run of a job about to start, kept open by this process (run_owner: the
    node-0 agent). A new run gets params, tags, config, placement and plan artifacts, and
    the tags and name suffix its job directory was created with (a sweep point's nest it
    under the sweep's run); a job that ran before (a restart, a requeue, a re-run of its
    job directory) gets its own run back, RUNNING again. Returns its id."""
    job = job_record(Path(job_dir))
    tags, name_suffix = job.get(RUN_TAGS_KEY), job.get(RUN_NAME_SUFFIX_KEY, "")
    layout = ParallelLayout.from_config(cfg)
    uri = tracking_uri(cfg.tracking)
    client = client_for(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment, uri)
    existing = find_run(client, exp_id, JOB_ID_TAG, job["job_id"])
    if existing is not None:
        run_id = existing.info.run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, STATUS_TAG, "running")
    else:
        run_id = create_job_run(client, exp_id, cfg, layout, Path(job_dir), tags=tags, name_suffix=name_suffix)
    run_owner.claim(Path(job_dir), run_id)
    return run_id


class MetricsLogger:
    """The MLflow sink of the logging rank's step metrics (gridwright.runtime.metric_sinks),
    writing into the run the agent opened.

    Tracking never stops training: the first failure (a store gone, a server down) is
    reported once and logging stops; the job directory holds every metric, and `python -m
    gridwright.tracking.sync DIR` catches MLflow up later. `skip_logged`: a restarted job
    repeats steps the run already holds (MLflow keeps every value), which are not logged
    again."""

    def __init__(self, tracking, run_id: str, job_dir: Path | None = None, skip_logged: bool = False):
        from mlflow.tracking import MlflowClient

        bound_http_waits()
        quiet_store_errors()
        self.client = MlflowClient(tracking_uri(tracking))
        self.run_id, self.job_dir = run_id, job_dir
        self.failed: str | None = None
        self.logged = self.logged_steps("loss") if skip_logged else set()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if self.failed or step in self.logged:
            return
        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in headline.step_metrics(metrics).items()]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as e:  # noqa: BLE001 - any failure of the store: training goes on
            self.failed = one_line(e)
            print(tracking_failure_line(f"logging step {step}", self.failed, self.job_dir), flush=True)

    def logged_steps(self, key: str) -> set[int]:
        """The steps at which the run holds a value of `key`."""
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}


def tracking_failure_line(what: str, error: str, job_dir: Path | None) -> str:
    """The one line a tracking failure gets: what failed, and how MLflow catches up."""
    later = f"python -m gridwright.tracking.sync {job_dir}" if job_dir else "python -m gridwright.tracking.sync JOB_DIR"
    return (f"mlflow      {what} failed ({error}); the job directory keeps the record (training is not "
            f"stopped for MLflow): {later} logs it later")


def one_line(e: BaseException) -> str:
    """An exception in one line: the line that names the underlying error, when one does
    (SQLAlchemy's messages put it second, after advice)."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    named = next((line for line in text if "Error)" in line or "Error:" in line), text[0] if text else "")
    return f"{type(e).__name__}: {named[:300]}" if named else type(e).__name__


def quiet_store_errors() -> None:
    """MLflow's SQL store logs each failed query with its traceback at ERROR; gridwright
    reports a tracking failure itself, in one line (tracking_failure_line)."""
    import logging

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def close_run(tracking, run_id: str, status: str, job_dir: Path | None = None, error: str | None = None) -> None:
    """End a live run as finished, failed or killed; with `job_dir`, first log what the
    run left there (as sync would)."""
    client = client_for(tracking_uri(tracking))
    if job_dir is not None:
        log_job_results(client, run_id, Path(job_dir), step_metrics=False)
    client.set_tag(run_id, STATUS_TAG, status)
    if error:
        client.set_tag(run_id, ERROR_TAG, error[:5000])
    client.set_terminated(run_id, status=MLFLOW_STATUS[status])


def close_orphaned_run(tracking, launcher, job_dir: Path, status: str, error: str | None = None,
                       ended_by_us: bool = False) -> str | None:
    """Close the job's run if it is still RUNNING but the process that kept it open is
    gone (killed, or crashed before closing it); returns the run id when it did. `error`
    says why, when the caller knows (a hang the watchdog found). `ended_by_us`: the
    launcher ended a stuck agent, and the run is `status` even if the workers finished."""
    owner = run_owner.owner(job_dir)
    if not owner or run_owner.owner_gone(owner) is not True:
        return None
    client = client_for(tracking_uri(tracking))
    try:
        run = client.get_run(owner["run_id"])
    except Exception:  # noqa: BLE001 - a store that lost the run: nothing to close
        return None
    if run.info.status != "RUNNING":
        return None
    if not ended_by_us and job_outcome(launcher, Path(job_dir)) == "finished":
        status = "finished"  # the owner died after the run's last write
    close_run(tracking, run.info.run_id, status, job_dir,
              error=None if status == "finished" else error or
              f"pid {owner['pid']} on {owner['host']}, which kept this run open, ended without closing it")
    return run.info.run_id


def where_to_see(uri: str, run_id: str) -> list[str]:
    """Terminal lines that lead from a finished run to the MLflow UI: the experiment's runs
    table with the headline columns (runs_view), and the run's own page."""
    client = client_for(uri)
    run = client.get_run(run_id)
    exp_id = run.info.experiment_id
    lines = [f"mlflow      run {run_id} ({run.info.status}) in {uri}"]
    base = runs_view.ui_base(uri)
    if base is None:
        return lines
    if base == runs_view.LOCAL_UI:
        lines.append(see_it(uri))
    lines.append(f"            compare: {runs_view.runs_table_url(base, exp_id)}")
    lines.append(f"            this run: {runs_view.run_url(base, exp_id, run_id)}")
    return lines


# Sweeps ---------------------------------------------------------------------
def sweep_run(client, exp_id: str, sweep_dir: Path, record) -> tuple[str, bool]:
    """The parent run of a sweep (found by the sweep's id, else created)."""
    existing = find_run(client, exp_id, SWEEP_ID_TAG, record.id)
    if existing is not None:
        return existing.info.run_id, False
    tags = {
        SWEEP_ID_TAG: record.id,
        "gridwright.experiment": record.experiment,
        "gridwright.sweep_dir": str(sweep_dir),
        "gridwright.overrides": " ".join(record.overrides)[:5000],
        "mlflow.source.git.commit": git_commit(),
    }
    run = client.create_run(exp_id, start_time=record.started_ms, run_name=record.name, tags=tags)
    _log_params(client, run.info.run_id, {"sweep.overrides": " ".join(record.overrides)})
    return run.info.run_id, True


def _override_params(overrides: list[str]) -> dict[str, str]:
    """`key=value` command-line overrides as params (`+experiment=x` gives `experiment`)."""
    return {override_key(item): item.partition("=")[2] for item in overrides if "=" in item}


def log_sweep_point(client, exp_id: str, sweep_dir: Path, record, point: dict, parent_run_id: str) -> tuple[str, bool]:
    """One point of a sweep as a run nested under the sweep's run, unless already logged.
    A point with a job directory is logged as that job; an invalid point, which has none,
    from its record in sweep.json (its overrides as params, the error as a tag)."""
    tags = {PARENT_TAG: parent_run_id, SWEEP_POINT_TAG: str(point["num"])}
    job_dir = record.job_dir_of(point, sweep_dir)
    if job_dir is not None and job_dir.is_dir():
        return log_job_dir(client, exp_id, job_dir, status=point["status"], tags=tags,
                           name_suffix=name_suffix(record.overrides, point.get("overrides", [])),
                           end_ms=point.get("ended_ms"))
    existing = find_run(client, exp_id, JOB_ID_TAG, point["job_id"])
    if existing is not None:
        return existing.info.run_id, False
    tags.update({JOB_ID_TAG: point["job_id"], STATUS_TAG: point["status"], "gridwright.experiment": record.experiment,
                 "gridwright.layout": point.get("layout", ""), "mlflow.source.git.commit": git_commit()})
    if point.get("error"):
        tags[ERROR_TAG] = point["error"][:5000]
    run = client.create_run(exp_id, start_time=point.get("started_ms"), run_name=point["name"], tags=tags)
    _log_params(client, run.info.run_id, _override_params(point.get("overrides", [])))
    client.set_terminated(run.info.run_id, status=MLFLOW_STATUS.get(point["status"], "FAILED"),
                          end_time=point.get("ended_ms"))
    return run.info.run_id, True


def finish_sweep(client, parent_run_id: str, sweep_dir: Path, record, report: SweepReport) -> None:
    """The parent's comparison table, plots and best point (its headline metrics are the
    best point's), the shared view of its points; then its end."""
    from mlflow.entities import Metric

    for path in report.files:
        client.log_artifact(parent_run_id, str(path))
    for path in (sweep_dir / "sweep.json", sweep_dir / "multirun.yaml"):
        if path.is_file():
            client.log_artifact(parent_run_id, str(path))
    stamp = record.ended_ms or int(time.time() * 1000)
    client.set_tag(parent_run_id, "gridwright.points", report.counts_text())
    if report.best is not None:
        client.set_tag(parent_run_id, "gridwright.best_point", f"#{report.best['num']} {report.best['name']}")
        client.set_tag(parent_run_id, "gridwright.best_by", report.best_by)
        _log_metrics(client, parent_run_id, [Metric(k, v, stamp, 0) for k, v in report.best_metrics().items()])
    exp_id = client.get_run(parent_run_id).info.experiment_id
    runs_view.publish(client, exp_id, runs_view.sweep_view_key(parent_run_id), runs_view.sweep_view_state(parent_run_id))
    ended = record.status == "finished"
    client.set_tag(parent_run_id, STATUS_TAG, record.status if ended else "interrupted")
    client.set_terminated(parent_run_id, status="FINISHED" if ended else "KILLED", end_time=stamp)


def log_sweep(client, exp_id: str, sweep_dir: Path, record) -> tuple[str, int]:
    """A sweep directory as a parent run with a nested run per point, idempotently: only
    what is missing is logged; the parent's report is (re)made when anything was.
    Returns (parent run id, runs created)."""
    parent, created = sweep_run(client, exp_id, sweep_dir, record)
    count = int(created)
    for point in record.points:
        count += log_sweep_point(client, exp_id, sweep_dir, record, point, parent)[1]
    if count or client.get_run(parent).info.status == "RUNNING":
        finish_sweep(client, parent, sweep_dir, record, write_report(sweep_dir, record))
    return parent, count


def sweep_links(uri: str, parent_run_id: str) -> list[str]:
    """Terminal lines that lead from a sweep to the MLflow UI: its points in the runs table
    with the headline columns, and the parent run, whose artifacts hold the sweep's chart."""
    base = runs_view.ui_base(uri)
    if base is None:
        return []
    exp_id = client_for(uri).get_run(parent_run_id).info.experiment_id
    lines = [see_it(uri)] if base == runs_view.LOCAL_UI else []
    lines.append(f"            compare: {runs_view.runs_table_url(base, exp_id, runs_view.sweep_view_key(parent_run_id))}")
    if any(f.path == POINTS_PNG for f in client_for(uri).list_artifacts(parent_run_id)):  # a plan-only sweep has none
        lines.append(f"            chart: {runs_view.run_url(base, exp_id, parent_run_id, POINTS_PNG)}")
    return lines


def see_it(uri: str) -> str:
    """How to serve a local store, and the address the links after it assume."""
    port = runs_view.LOCAL_UI.rsplit(":", 1)[1]
    return (f"            see it: mlflow ui --backend-store-uri {uri} (port {port}, its default, "
            "which the links below assume)")


# Layout advice ---------------------------------------------------------------
def log_advice(tracking, job_dir: Path, record: dict) -> list[str]:
    """`launcher=advise`'s ranking as one parent run (the search: model, cluster, counts,
    advise.json) with a nested run per top layout (its overrides as params, its predicted
    speed, memory and parts as metrics), compared side by side like a sweep's points.
    Returns the lines that lead to them, and each layout's run id by its rank."""
    from mlflow.entities import Metric

    uri = tracking_uri(tracking)
    client = client_for(uri)
    exp_id = experiment_id(client, tracking.experiment, uri)
    stamp = int(time.time() * 1000)
    name = unique_run_name(client, exp_id, f"advise-{record['model']}-{record['gpus']}x{record['card']}")
    parent = client.create_run(exp_id, start_time=stamp, run_name=name, tags={
        STATUS_TAG: "planned", "gridwright.kind": "advice", "gridwright.job_dir": str(job_dir),
        "mlflow.source.git.commit": git_commit()}).info.run_id
    _log_params(client, parent, {k: str(record[k]) for k in ("model", "cluster", "gpus", "card", "global_batch_size",
                                                            "seq_length", "precision", "flops_definition")}
                | {f"layouts.{k}": str(v) for k, v in record["counted"].items()})
    client.log_artifact(parent, str(job_dir / ADVICE_FILE))
    children = {}
    for top in record["top"]:
        child = client.create_run(exp_id, start_time=stamp, run_name=f"#{top['rank']} {top['layout']}", tags={
            PARENT_TAG: parent, STATUS_TAG: "planned", "gridwright.layout": top["layout"],
            "gridwright.advice_rank": str(top["rank"])}).info.run_id
        _log_params(client, child, {k: str(v).lower() if isinstance(v, bool) else str(v)
                                    for k, v in top["overrides"].items()})
        metrics = {"predicted_tokens_per_s_per_gpu": top["tokens_per_s_per_gpu"], "predicted_mfu": top["mfu"],
                   "predicted_step_time_s": top["step_s"], "memory_estimate_gib": top["memory_gib"],
                   "predicted_host_s": top["host_s"],
                   **{f"predicted_{part.replace(' ', '_')}_s": s for part, s in top["parts"].items()}}
        _log_metrics(client, child, [Metric(k, float(v), stamp, 0) for k, v in metrics.items()])
        client.set_terminated(child, status="FINISHED", end_time=stamp)
        children[top["rank"]] = child
    runs_view.publish(client, exp_id, runs_view.sweep_view_key(parent), runs_view.sweep_view_state(parent))
    client.set_terminated(parent, status="FINISHED", end_time=stamp)
    return sweep_links(uri, parent), children


def log_verified(tracking, children: dict, verified: list[dict]) -> None:
    """The measured speed of each layout `launcher.verify` ran, on its advice run (beside
    the prediction), with the run of the measurement named."""
    from mlflow.entities import Metric

    client = client_for(tracking_uri(tracking))
    stamp = int(time.time() * 1000)
    for v in verified:
        child = children.get(v["rank"])
        if child is None or not v.get("measured_tokens_per_s_per_gpu"):
            continue
        metrics = {"measured_tokens_per_s_per_gpu": v["measured_tokens_per_s_per_gpu"],
                   "measured_step_time_s": v["measured_step_s"]}
        if v.get("measured_mfu") is not None:
            metrics["measured_mfu"] = v["measured_mfu"]
        _log_metrics(client, child, [Metric(k, float(x), stamp, 0) for k, x in metrics.items()])
        client.set_tag(child, "gridwright.verified_in", v["job_dir"])
