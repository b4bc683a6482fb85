"""The headline metrics: the few numbers people compare runs by, under short names in the
units they read (ms, GiB, %), the same in MLflow, the sweep tables and the terminal.

A run's MLflow record holds these and the per-step curves below; everything else a run
measured stays in its JSON artifacts (summary.json, metrics.jsonl, communication.json),
so that the runs table offers a short, stable list instead of every number ever logged.
"""
from __future__ import annotations

# Per run, in the order the runs table shows them: (metric, what it is).
RUN_METRICS = (
    ("tok_s_gpu", "tokens/s per GPU, mean over the steps after the first"),
    ("mfu_megatron_pct", "MFU %, Megatron's FLOPs (causal attention at half)"),
    ("mfu_palm_pct", "MFU %, PaLM's FLOPs (attention in full)"),
    ("step_ms", "mean step time, ms"),
    ("exposed_comm_ms", "communication not hidden behind compute, ms per step"),
    ("peak_mem_gib", "peak memory of the busiest rank, GiB"),
    ("final_loss", "loss at the last step"),
)
# Exposed communication per parallel group (tp, cp, ep, pp, dp ...), when traced.
EXPOSED_GROUP = "exposed_{group}_ms"
GROUP_ORDER = ("tp", "cp", "ep", "etp", "pp", "dp", "edp")

# Per step, for the curves: (metric, field of a metrics.jsonl row, scale).
STEP_METRICS = (
    ("loss", "loss", 1.0),
    ("lr", "lr", 1.0),
    ("grad_norm", "grad_norm", 1.0),
    ("step_time_ms", "step_time_s", 1000.0),
    ("step_tok_s_gpu", "tokens_per_s_per_gpu", 1.0),
    # dynamic context parallelism only (dynamic_cp): slowest rank's busy time over the mean,
    # and the swap's cost (scheduling, the barriers between CP-group changes)
    ("cp_straggler", "cp_straggler", 1.0),
    ("cp_schedule_ms", "cp_schedule_ms", 1.0),
    ("cp_barrier_ms", "cp_barrier_ms", 1.0),
)
# Per run with dynamic context parallelism (summary.json's `dynamic_cp`): (metric, key).
DYNAMIC_CP_METRICS = (
    ("cp_straggler", "straggler"),
    ("cp_imbalance_estimated", "imbalance_estimated"),
    ("cp_swap_ms", "swap_ms"),
)


def _num(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return float(value) if ok else None


def mfu_both(summary: dict, plan: dict) -> tuple[float | None, float | None]:
    """MFU (a fraction) under the Megatron and the PaLM FLOPs definitions. A summary's `mfu`
    is under the run's own definition; the other follows from the ratio of FLOPs per token."""
    definition = summary.get("flops_definition") or plan.get("flops_definition") or "megatron"
    per_token = next((d for d in (plan.get("flops_per_token"), summary.get("flops_per_token"))
                      if isinstance(d, dict)), {})
    mfu = {}
    if _num(summary.get("mfu")) is not None:
        mfu[definition] = _num(summary["mfu"])
    if _num(summary.get("mfu_palm")) is not None:
        mfu["palm"] = _num(summary["mfu_palm"])
    for other in ("megatron", "palm"):
        if other not in mfu and definition in mfu and _num(per_token.get(other)) and _num(per_token.get(definition)):
            mfu[other] = mfu[definition] * per_token[other] / per_token[definition]
    return mfu.get("megatron"), mfu.get("palm")


def exposed_by_group(summary: dict) -> dict[str, float]:
    """Exposed communication per parallel group in ms, in a fixed group order."""
    comm = summary.get("communication") if isinstance(summary.get("communication"), dict) else {}
    groups = comm.get("by_group") if isinstance(comm.get("by_group"), dict) else {}
    out = {g: 1000 * _num(v.get("exposed_s")) for g, v in groups.items()
           if isinstance(v, dict) and _num(v.get("exposed_s")) is not None}
    rank = {g: i for i, g in enumerate(GROUP_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def run_metrics(summary: dict, plan: dict) -> dict[str, float]:
    """The headline numbers of a finished run (summary.json and plan.json); a number the
    run did not measure (MFU on a CPU, exposed communication without a trace) is absent."""
    comm = summary.get("communication") if isinstance(summary.get("communication"), dict) else {}
    megatron, palm = mfu_both(summary, plan)
    step_s, exposed_s = _num(summary.get("mean_step_time_s")), _num(comm.get("exposed_comm_s"))
    values = {
        "tok_s_gpu": _num(summary.get("tokens_per_s_per_gpu")),
        "mfu_megatron_pct": None if megatron is None else 100 * megatron,
        "mfu_palm_pct": None if palm is None else 100 * palm,
        "step_ms": None if step_s is None else 1000 * step_s,
        "exposed_comm_ms": None if exposed_s is None else 1000 * exposed_s,
        "peak_mem_gib": _num(summary.get("memory_peak_gib")),
        "final_loss": _num(summary.get("last_loss")),
    }
    values.update({EXPOSED_GROUP.format(group=g): ms for g, ms in exposed_by_group(summary).items()})
    dynamic = summary.get("dynamic_cp") if isinstance(summary.get("dynamic_cp"), dict) else {}
    values.update({name: _num(dynamic.get(key)) for name, key in DYNAMIC_CP_METRICS})
    return {k: readable(k, v) for k, v in values.items() if v is not None}


def readable(name: str, value: float) -> float:
    """The value rounded to what a table cell shows and a comparison needs (MLflow prints
    every digit it holds: 29.48949... in a column 8 characters wide); summary.json keeps
    the exact one."""
    ratios = ("final_loss", "cp_straggler", "cp_imbalance_estimated")
    places = 4 if name in ratios else 3 if name.endswith("_gib") else 1 if name == "tok_s_gpu" else 2
    return round(value, places)


def step_metrics(row: dict) -> dict[str, float]:
    """The curves of one metrics.jsonl row (the step number excluded)."""
    out = {}
    for name, field, scale in STEP_METRICS:
        value = _num(row.get(field))
        if value is not None:
            out[name] = value * scale
    return out


def table_metric_names(groups=GROUP_ORDER) -> list[str]:
    """Every run metric the runs table shows, per-group exposure after the total."""
    names = [name for name, _ in RUN_METRICS]
    at = names.index("exposed_comm_ms") + 1
    return names[:at] + [EXPOSED_GROUP.format(group=g) for g in groups] + names[at:]
