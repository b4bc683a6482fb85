"""The comparison of a sweep's points: a table (Markdown and CSV) and plots.

Read from each point's job directory (`summary.json`, `plan.json`) and the sweep's
record (`sweep.json`); written into the sweep directory, and logged to the sweep's
parent MLflow run by gridwright.tracking.mlflow_runs. Any field may be missing (a plan-only point,
a CPU run without MFU, a run without communication measurements): its cell stays empty.

Columns: tokens/s/GPU and step time are means over the steps after the first; MFU is
model FLOP/s per GPU over the GPU's dense peak, under Megatron's FLOPs definition (causal
attention halved) and PaLM's (attention in full); compute, exposed communication per
group and idle (pipeline bubble included) split the mean step, in ms.
"""
from __future__ import annotations

import csv
import io
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..basics.conf_dir import PRESET_GROUPS

from ..basics.atomic_io import write_text_atomic
from ..runtime.jobdir import PLAN_FILE, SUMMARY_FILE, read_json
from .headline import mfu_both, run_metrics

COMPARISON_MD = "comparison.md"
COMPARISON_CSV = "comparison.csv"
MFU_PNG = "mfu.png"
BREAKDOWN_PNG = "step_breakdown.png"
THROUGHPUT_PNG = "throughput.png"
POINTS_PNG = "points.png"  # final loss and MFU (or tokens/s) per point: the parent run's chart
COMM_PROFILE_PNG = "comm_profile.png"  # alpha-beta fits of the cluster's collectives


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ms(seconds) -> float | None:
    s = _num(seconds)
    return None if s is None else 1000 * s


def point_label(point: dict) -> str:
    return f"{point['num']}-{point.get('slug', '')}"


def override_key(item: str) -> str:
    """`parallel.tp` of `parallel.tp=2`, `experiment` of `+experiment=x`."""
    return item.partition("=")[0].lstrip("+~")


def swept_keys(overrides: list[str]) -> set[str]:
    """Keys the sweep varies (`parallel.tp=1,2`, `range(...)`, `choice(...)`, `glob(...)`),
    as Hydra's own parser tells a sweep from a list value such as `[1,3]`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {override_key(o.input_line) for o in parsed if o.is_sweep_override()}


def name_suffix(sweep_overrides: list[str], point_overrides: list[str]) -> str:
    """What tells a point's run apart when the sweep varies more than the layout: the
    point's values of the swept keys outside `parallel.*` (a swept preset by its name)."""
    varied = {k for k in swept_keys(sweep_overrides) if not k.startswith("parallel.")}
    parts = []
    for item in point_overrides:
        key, _, value = item.partition("=")
        if override_key(item) in varied:
            parts.append(value if override_key(item) in PRESET_GROUPS else f"{key.lstrip('+~')}={value}")
    return " ".join(parts)


def point_row(sweep_dir: Path, record, point: dict) -> dict:
    """One row of the comparison: what the point's records say (None where silent)."""
    job_dir = record.job_dir_of(point, sweep_dir)
    summary = read_json(job_dir / SUMMARY_FILE) if job_dir else {}
    plan = read_json(job_dir / PLAN_FILE) if job_dir else {}
    comm = summary.get("communication") if isinstance(summary.get("communication"), dict) else {}
    groups = comm.get("by_group") if isinstance(comm.get("by_group"), dict) else {}
    varied = set(swept_keys(record.overrides))
    mfu, mfu_palm = mfu_both(summary, plan)
    estimate = _num(summary.get("memory_estimate_gib"))
    predicted = plan.get("predicted_step") if isinstance(plan.get("predicted_step"), dict) else {}
    return {
        "num": point["num"],
        "label": point_label(point),
        "name": point.get("name", ""),
        "point": " ".join(o for o in point.get("overrides", []) if override_key(o) in varied),
        "status": point.get("status", ""),
        "layout": point.get("layout", ""),
        "tokens_per_s_per_gpu": _num(summary.get("tokens_per_s_per_gpu")),
        "mfu": mfu,
        "mfu_palm": mfu_palm,
        "step_time_ms": _ms(summary.get("mean_step_time_s")),
        "predicted_tokens_per_s_per_gpu": _num(predicted.get("tokens_per_s_per_gpu")),
        "predicted_mfu": _num(predicted.get("mfu")),
        "predicted_step_time_ms": _ms(predicted.get("step_s")),
        "memory_peak_gib": _num(summary.get("memory_peak_gib")),
        "memory_estimate_gib": estimate if estimate is not None else _num(plan.get("memory_estimate_gib")),
        "compute_ms": _ms(comm.get("compute_s")),
        "exposed_comm_ms": _ms(comm.get("exposed_comm_s")),
        "exposed_ms": {g: _ms(v.get("exposed_s")) for g, v in groups.items() if isinstance(v, dict)},
        "idle_ms": _ms(comm.get("idle_s")),
        "final_loss": _num(summary.get("last_loss")),
        "error": point.get("error", ""),
        "headline": run_metrics(summary, plan),  # what the point's own MLflow run shows
    }


@dataclass
class SweepReport:
    rows: list[dict]
    files: list[Path] = field(default_factory=list)  # to log as the parent run's artifacts
    notes: list[str] = field(default_factory=list)
    best: dict | None = None
    best_by: str = ""

    def counts_text(self) -> str:
        counts = {}
        for row in self.rows:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no points"

    def best_metrics(self) -> dict[str, float]:
        """The best point's headline metrics (gridwright.tracking.headline names): the
        parent run's row in the runs table shows them."""
        return dict(self.best["headline"]) if self.best else {}

    def terminal_lines(self) -> list[str]:
        """The end-of-sweep table: one line per point, the numbers of the comparison."""
        predicted = any(r["predicted_tokens_per_s_per_gpu"] is not None for r in self.rows)
        head = (f"  {'#':>2}  {'point':<34} {'status':<9} {'tok/s/GPU':>10} {'MFU %':>6} {'step ms':>8} "
                f"{'exposed ms':>10} {'peak GiB':>8} {'loss':>7}"
                + (f" {'predicted tok/s/GPU':>19} {'MFU %':>6} {'est. GiB':>8}" if predicted else ""))
        lines = [head]
        for r in self.rows:
            lines.append(
                f"  {r['num']:>2}  {(r['name'] or r['label'])[:34]:<34} {r['status']:<9} "
                f"{_fmt(r['tokens_per_s_per_gpu'], ',.0f'):>10} {_fmt(r['mfu'], '.1f', 100):>6} "
                f"{_fmt(r['step_time_ms'], '.1f'):>8} {_fmt(r['exposed_comm_ms'], '.1f'):>10} "
                f"{_fmt(r['memory_peak_gib'], '.2f'):>8} {_fmt(r['final_loss'], '.4f'):>7}"
                + (f" {_fmt(r['predicted_tokens_per_s_per_gpu'], ',.0f'):>19} {_fmt(r['predicted_mfu'], '.1f', 100):>6}"
                   f" {_fmt(r['memory_estimate_gib'], '.1f'):>8}" if predicted else ""))
            if r["error"]:
                lines.append(f"      {r['error'][:150]}")
        return lines


def groups_of(rows: list[dict]) -> list[str]:
    order = ["dp", "tp", "cp", "pp", "ep", "etp", "edp"]
    found = {g for r in rows for g in r["exposed_ms"]}
    return [g for g in order if g in found] + sorted(found - set(order))


def best_row(rows: list[dict]) -> tuple[dict | None, str]:
    """The finished point with the highest MFU (Megatron definition), or, where no point
    knows its MFU (no known peak, e.g. CPU), the highest tokens/s/GPU."""
    finished = [r for r in rows if r["status"] == "finished"]
    for key in ("mfu", "tokens_per_s_per_gpu"):
        scored = [r for r in finished if r[key] is not None]
        if scored:
            return max(scored, key=lambda r: r[key]), key
    return None, ""


def _fmt(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "" if value is None else f"{value * scale:{spec}}{suffix}"


def _memory_cell(row: dict) -> str:
    peak, est = row["memory_peak_gib"], row["memory_estimate_gib"]
    if peak is None and est is None:
        return ""
    return f"{_fmt(peak, '.2f') or '–'} / {_fmt(est, '.2f') or '–'}"


def comparison_markdown(record, rows: list[dict], notes: list[str]) -> str:
    """The table for people: measurement columns no point has a value for are left out
    (and named under it); comparison.csv keeps every column."""
    groups = groups_of(rows)
    fixed = [("#", lambda r: str(r["num"])), ("name", lambda r: r["name"]),
             ("point", lambda r: f"`{r['point']}`" if r["point"] else ""), ("status", lambda r: r["status"]),
             ("layout", lambda r: r["layout"])]
    measured = [
        ("tokens/s/GPU", lambda r: _fmt(r["tokens_per_s_per_gpu"], ",.0f")),
        ("predicted tokens/s/GPU", lambda r: _fmt(r["predicted_tokens_per_s_per_gpu"], ",.0f")),
        ("predicted MFU", lambda r: _fmt(r["predicted_mfu"], ".1f", 100, " %")),
        ("predicted step (ms)", lambda r: _fmt(r["predicted_step_time_ms"], ".1f")),
        ("MFU (megatron)", lambda r: _fmt(r["mfu"], ".1f", 100, " %")),
        ("MFU (palm)", lambda r: _fmt(r["mfu_palm"], ".1f", 100, " %")),
        ("step time (ms)", lambda r: _fmt(r["step_time_ms"], ".1f")),
        ("peak / estimate memory (GiB)", _memory_cell),
        ("compute (ms)", lambda r: _fmt(r["compute_ms"], ".1f")),
        *[(f"exposed {g} (ms)", lambda r, g=g: _fmt(r["exposed_ms"].get(g), ".1f")) for g in groups],
        ("idle (ms)", lambda r: _fmt(r["idle_ms"], ".1f")),
        ("final loss", lambda r: _fmt(r["final_loss"], ".4f")),
    ]
    shown = [c for c in measured if any(c[1](r) for r in rows)]
    empty = [c[0] for c in measured if c not in shown]
    columns = fixed + shown
    lines = [f"# {record.name}", "", f"Overrides: `{' '.join(record.overrides)}`", "",
             "| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r).replace("|", "/") for _, cell in columns) + " |")
    if empty:
        lines += ["", f"No point has a value for: {', '.join(empty)}."]
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["", "Errors:", ""] + [f"- #{r['num']} {r['name']}: {r['error']}" for r in errors]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    lines += ["", "tokens/s/GPU and step time: means over the steps after the first. MFU: model FLOP/s per GPU "
              "over the GPU's dense peak; megatron counts causal attention at half, palm in full. "
              "compute, exposed communication per parallel group and idle (pipeline bubble included) "
              "split the mean step. Predicted: gridwright.planning.step_time on a calibrated card. "
              "Empty: not measured (plan-only or invalid point, unknown peak, no profile)."]
    return "\n".join(lines) + "\n"


def comparison_csv(rows: list[dict]) -> str:
    groups = groups_of(rows)
    cols = ["num", "name", "point", "status", "layout", "tokens_per_s_per_gpu", "mfu", "mfu_palm", "step_time_ms",
            "predicted_tokens_per_s_per_gpu", "predicted_mfu", "predicted_step_time_ms",
            "memory_peak_gib", "memory_estimate_gib", "compute_ms", "exposed_comm_ms",
            *[f"exposed_{g}_ms" for g in groups], "idle_ms", "final_loss", "error"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(cols)
    for r in rows:
        flat = {**r, **{f"exposed_{g}_ms": r["exposed_ms"].get(g) for g in groups}}
        writer.writerow(["" if flat[c] is None else flat[c] for c in cols])
    return out.getvalue()


# Plots ---------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def plot_mfu(rows: list[dict], path: Path) -> Path | None:
    shown = [r for r in rows if r["mfu"] is not None or r["mfu_palm"] is not None]
    if not shown:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(shown) + 2), 4))
    x = range(len(shown))
    for offset, key, label in ((-0.2, "mfu", "megatron"), (0.2, "mfu_palm", "palm")):
        ax.bar([i + offset for i in x], [100 * (r[key] or 0) for r in shown], width=0.4, label=label)
    ax.set_xticks(list(x), [r["label"] for r in shown], rotation=30, ha="right")
    top = max(100 * max(r["mfu"] or 0, r["mfu_palm"] or 0) for r in shown)
    ax.set_ylim(0, 1.25 * top or 1)  # room for the legend above the bars
    ax.set_ylabel("MFU (%)")
    ax.set_title("MFU per point (two FLOPs definitions)")
    ax.legend(loc="upper center", ncols=2)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_points(rows: list[dict], path: Path) -> Path | None:
    """The sweep's chart: final loss and MFU per point, side by side (tokens/s/GPU where no
    point knows its MFU, as on a CPU)."""
    shown = [r for r in rows if r["final_loss"] is not None]
    if not shown:
        return None
    by_mfu = any(r["mfu"] is not None for r in shown)
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(shown) + 4), 4))
    x, labels = range(len(shown)), [r["label"] for r in shown]
    left.bar(x, [r["final_loss"] for r in shown], color="tab:orange")
    left.set_ylabel("final loss")
    left.set_title("Final loss per point")
    if by_mfu:
        right.bar(x, [100 * (r["mfu"] or 0) for r in shown])
        right.set_ylabel("MFU (%), Megatron FLOPs")
        right.set_title("MFU per point")
    else:
        right.bar(x, [r["tokens_per_s_per_gpu"] or 0 for r in shown])
        right.set_ylabel("tokens/s per GPU")
        right.set_title("Throughput per point (no MFU: the peak is unknown)")
    for ax in (left, right):
        ax.set_xticks(list(x), labels, rotation=30, ha="right")
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_step_breakdown(rows: list[dict], path: Path) -> Path | None:
    shown = [r for r in rows if r["compute_ms"] is not None or r["exposed_ms"] or r["exposed_comm_ms"] is not None]
    if not shown:
        return None
    plt = _pyplot()
    groups = groups_of(shown)
    parts = [("compute", lambda r: r["compute_ms"])]
    parts += [(f"exposed {g}", lambda r, g=g: r["exposed_ms"].get(g)) for g in groups]
    if not groups:
        parts.append(("exposed communication", lambda r: r["exposed_comm_ms"]))
    parts.append(("idle (incl. bubble)", lambda r: r["idle_ms"]))
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(shown) + 2), 4))
    bottom = [0.0] * len(shown)
    for label, get in parts:
        values = [get(r) or 0.0 for r in shown]
        ax.bar(range(len(shown)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(shown)), [r["label"] for r in shown], rotation=30, ha="right")
    ax.set_ylim(0, 1.35 * max(bottom) or 1)
    ax.set_ylabel("ms per step")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=8, loc="upper center", ncols=2)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_throughput(rows: list[dict], path: Path) -> Path | None:
    shown = [r for r in rows if r["tokens_per_s_per_gpu"] is not None]
    if not shown:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(shown) + 2), 4))
    ax.bar(range(len(shown)), [r["tokens_per_s_per_gpu"] for r in shown])
    ax.set_xticks(range(len(shown)), [r["label"] for r in shown], rotation=30, ha="right")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title("Throughput per point")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def comm_profile(sweep_dir: Path, record) -> Path | None:
    """The sweep's alpha-beta fit plot: the sweep directory's, else the first point's, else
    drawn from the profile the points' plans name (cluster.comm_profile)."""
    if (sweep_dir / COMM_PROFILE_PNG).is_file():
        return sweep_dir / COMM_PROFILE_PNG
    for point in record.points:
        job_dir = record.job_dir_of(point, sweep_dir)
        if job_dir is not None and (job_dir / COMM_PROFILE_PNG).is_file():
            return job_dir / COMM_PROFILE_PNG
    for point in record.points:
        job_dir = record.job_dir_of(point, sweep_dir)
        named = read_json(job_dir / PLAN_FILE).get("comm_profile") if job_dir is not None else None
        if named and Path(named).is_file():
            from ..planning.comm_model import CommProfile, plot_profile

            try:
                return plot_profile(CommProfile.load(named), sweep_dir / COMM_PROFILE_PNG)
            except ImportError:  # no matplotlib: no plot
                return None
    return None


def write_report(sweep_dir: Path, record) -> SweepReport:
    """Write comparison.md/.csv and the plots into the sweep directory; return what to log."""
    sweep_dir = Path(sweep_dir)
    rows = [point_row(sweep_dir, record, p) for p in record.points]
    report = SweepReport(rows)
    report.best, report.best_by = best_row(rows)
    plots = ((POINTS_PNG, plot_points, "no point trained: no loss to chart"),
             (MFU_PNG, plot_mfu, "no point reports MFU (the GPU's peak is unknown, or nothing trained)"),
             (BREAKDOWN_PNG, plot_step_breakdown, "no point has communication measurements: no step breakdown"),
             (THROUGHPUT_PNG, plot_throughput, "no point trained: no throughput plot"))
    try:
        _pyplot()
    except ImportError:
        report.notes.append("matplotlib is not installed: no plots")
        plots = ()
    for name, plot, note in plots:
        made = plot(rows, sweep_dir / name)
        if made is None:
            report.notes.append(f"{name} not made: {note}")
        else:
            report.files.append(made)
    if report.best is not None:
        report.notes.append(f"best point by {report.best_by}: #{report.best['num']} {report.best['name']}")
    report.files = [write_text_atomic(sweep_dir / COMPARISON_MD, comparison_markdown(record, rows, report.notes)),
                    write_text_atomic(sweep_dir / COMPARISON_CSV, comparison_csv(rows)), *report.files]
    profile = comm_profile(sweep_dir, record)
    if profile is not None:
        report.files.append(profile)
    return report
