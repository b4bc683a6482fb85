"""Where each step's time goes, from the torch.profiler traces of a job's ranks.

For every traced step on every rank (the step's window is the `gridwright_step_N`
range, which spans exactly what the step timer measures):

* compute: time at least one non-communication GPU activity runs (kernels, copies, memsets)
* communication: time at least one NCCL kernel runs, split by kind (all_reduce,
  reduce_scatter, all_gather, all_to_all, send_recv, ...) and by parallel group of the
  placement (tp, cp, dp, pp, ep, ...)
* exposed communication: communication while no compute runs
* idle: neither (launch gaps, host work, pipeline bubbles), and the part of it that is
  `host_wait`: the GPU had run out of work because the host had not yet launched the next
  kernel (the launch call, matched to its kernel by the trace's correlation id, came after
  the GPU fell idle). A step whose idle is mostly host wait is bound by the host (Python,
  kernel launches), not by the GPU or the network; HolisticTraceAnalysis calls this the
  "host wait" share of idle time. Traces without launch records (trimmed) give None.
* overlap %: communication overlapped with compute / communication (the definition of
  HolisticTraceAnalysis' `get_comm_comp_overlap`)
* compute by class: time at least one kernel of a class runs, by its name: `matmul`
  (cuBLAS, cuBLASLt's float8 GEMMs, CUTLASS, inductor's matmul templates), `attention`
  (flash, cuDNN and memory-efficient SDPA) and `other` (elementwise, norms, casts,
  reductions, the optimizer, copies). It says what a faster matmul (FP8) can gain at most.

compute + exposed communication + idle = the step's window, by construction; the window
is checked against the step timer (`traces/rank_N.steps.json`) to show that the trace
and the timer see the same step.

NCCL kernels run from the moment a rank enters the collective, so they include the time
spent waiting for the slowest member (skew), not only transfer. Where every member's
trace is present, each collective is matched across its members (the k-th call on one
communicator is the k-th on all of them) and split at the last member's arrival: the part
before is `wait`, the part after `transfer`. This assumes the ranks share a clock (true on
one host; across hosts the split is reported only as a lower-quality estimate).

Why not HolisticTraceAnalysis itself: its overlap figure is one number per rank over the
whole trace, with no step windows, no process-group attribution and no skew split, and it
pulls in a large dependency tree; the interval arithmetic below is the same definition,
applied per step and per group. Checked against it once: on a whole DP=2 overlap trace
(2 x H100), HTA's `get_comm_comp_overlap` gave 59.4 % and 47.3 % on ranks 0 and 1,
this module's interval arithmetic 60.3 % and 48.0 % (60.2 % and 47.9 % with memory
copies not counted as compute; the remaining point was not traced further).

GPU traces only: a CPU (gloo) run has no device kernels (gloo collectives block the
calling thread), so the analysis says so instead of inventing numbers.
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime.profiling import STEP_RANGE_PREFIX, TRACES_DIR, step_times_path

COMMUNICATION_FILE = "communication.json"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Host-side launch records (cudaLaunchKernel, cuLaunchKernel for Triton, cudaMemcpyAsync, ...)
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")

# Megatron-Core's process-group descriptions -> the placement's group kinds.
GROUP_OF_DESCRIPTION = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP_AG": "dp",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "dp",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "EMBEDDING_GROUP": "pp",
    "POSITION_EMBEDDING_GROUP": "pp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_DATA_PARALLEL_GROUP": "edp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp",
    "MODEL_PARALLEL_GROUP": "mp",
    "default_pg": "world",
}
# Dynamic context parallelism's groups of k ranks (Megatron-Core's hybrid groups, and
# gridwright's own for k = every DP rank, dynamic_cp): reported as "cp<k>".
HYBRID_CP_PREFIX = "HYBRID_DP_CP_GROUP_"
# The placement kind whose members a description's "Process Group Ranks" must equal.
PLACEMENT_KIND_OF_DESCRIPTION = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "EXPERT_DATA_PARALLEL_GROUP": "edp",
    "MODEL_PARALLEL_GROUP": "mp",
}
# Communicators with a description Megatron-Core did not give (DeepSpeed's groups are
# torch's "undefined"; a user's own) are attributed by their members: the planned group
# of this rank with the same members, tried in this order (with TP=1 the expert-DP group
# of a dense model is the DP group, and DP is what it stands for). So is the default
# group in a trace where no communicator has a Megatron-Core name (DeepSpeed on its
# Hugging Face model, whose ZeRO-3 gathers over it); beside Megatron's groups it stays
# "world".
KINDS_BY_MEMBERS = ("tp", "cp", "dp", "pp", "ep", "etp", "edp")
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Int": 4, "Long": 8, "Byte": 1, "Char": 1}


# Kernel-name fragments of each compute class, tried in this order (cuDNN's attention
# kernels also name their GEMM instructions); anything else is `other`.
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "triton_tem", "splitkreduce", "scaled_mm")),
)


def kernel_class(name: str) -> str:
    lower = name.lower()
    return next((cls for cls, fragments in KERNEL_CLASSES if any(f in lower for f in fragments)), "other")


class TraceError(ValueError):
    """Traces that cannot be analysed; the message says why."""


# Interval arithmetic on sorted, disjoint [start, end) rows -------------------
def union(intervals) -> np.ndarray:
    a = np.asarray(intervals, dtype=np.float64).reshape(-1, 2)
    if len(a) == 0:
        return a
    a = a[np.argsort(a[:, 0], kind="stable")]
    out = [a[0].copy()]
    for s, e in a[1:]:
        if s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append(np.array([s, e]))
    return np.array(out)


def total(u: np.ndarray) -> float:
    return float((u[:, 1] - u[:, 0]).sum()) if len(u) else 0.0


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if s < e:
            out.append((s, e))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return np.array(out, dtype=np.float64).reshape(-1, 2)


def clip(u: np.ndarray, lo: float, hi: float) -> np.ndarray:
    c = np.clip(u, lo, hi)
    return c[c[:, 1] > c[:, 0]]


# One rank's trace -------------------------------------------------------------
@dataclass
class Collective:
    start: float  # microseconds, the trace's clock
    end: float
    kind: str  # all_reduce | reduce_scatter | all_gather | all_to_all | send_recv | ...
    group: str  # tp | cp | dp | pp | ep | ...
    communicator: str  # key that is the same on every member: description + ranks
    bytes: int  # nccl-tests convention: the larger of input and output; -1: not recorded


@dataclass
class RankTrace:
    rank: int
    steps: dict[int, tuple[float, float]]  # step -> window (us)
    compute: np.ndarray  # union of non-communication GPU activity
    collectives: list[Collective] = field(default_factory=list)
    unknown_groups: set = field(default_factory=set)
    # Every GPU activity's start, sorted, and the host time its launch was called (NaN:
    # no launch record); launches is None when the trace holds no launch records at all.
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    launches: np.ndarray | None = None
    # union of the compute activity of each class (kernel_class)
    compute_classes: dict[str, np.ndarray] = field(default_factory=dict)


def collective_kind(name: str, collective: str | None) -> str:
    text = (collective or name).lower()
    for key, kind in (("all_to_all", "all_to_all"), ("alltoall", "all_to_all"),
                      ("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"),
                      ("allgather", "all_gather"), ("all_gather", "all_gather"),
                      ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
                      ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send_recv"),
                      ("recv", "send_recv"), ("barrier", "barrier")):
        if key in text:
            return kind
    return "other"


def _is_communication(e: dict) -> bool:
    return e["name"].startswith("nccl") or "Collective name" in e.get("args", {})


def planned_groups(placement: dict, rank: int) -> dict[str, list[int]]:
    """The members of each planned group of `rank` (placement.json), by kind."""
    ids = placement["ranks"][rank]["group_ids"]
    return {kind: placement["groups"][kind][ids[kind]] for kind in KINDS_BY_MEMBERS if kind in ids}


def group_by_members(ranks_text: str, planned: dict[str, list[int]]) -> str | None:
    """The planned group kind whose members are `ranks_text` ("[0, 1]"), or None."""
    try:
        ranks = json.loads(ranks_text)
    except (TypeError, ValueError):
        return None
    return next((kind for kind in KINDS_BY_MEMBERS if planned.get(kind) == ranks), None)


def load_rank_trace(path: Path, layout_pp: int, planned: dict[str, list[int]] | None = None,
                    replayed_group: str | None = None) -> RankTrace:
    """Read one rank's gzip Chrome trace into step windows, compute and collectives;
    `planned` (planned_groups) attributes communicators Megatron-Core did not describe;
    `replayed_group` (graph_replayed_group) is the group of kernels that carry no record."""
    try:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: unreadable trace ({e})") from e
    rank = int(doc.get("distributedInfo", {}).get("rank", re.findall(r"\d+", path.name)[0]))
    steps, compute, collectives, unknown, classed = {}, [], [], set(), {}
    megatron_named = False  # whether any communicator carries a Megatron-Core group name
    launch_ts, activity = {}, []  # correlation id -> host launch time; (start, correlation id)
    for e in doc.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name", "")
        if cat == "user_annotation" and name.startswith(STEP_RANGE_PREFIX):
            steps[int(name[len(STEP_RANGE_PREFIX):])] = (e["ts"], e["ts"] + e["dur"])
        elif cat in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
        elif cat in GPU_CATEGORIES:
            span = (e["ts"], e["ts"] + e["dur"])
            activity.append((e["ts"], e.get("args", {}).get("correlation")))
            if cat == "kernel" and _is_communication(e):
                a = e.get("args", {})
                desc = a.get("Process Group Description")
                if desc is None:
                    # Batched point-to-point kernels carry no process-group record; in
                    # Megatron-Core they come from the pipeline schedule. Nor do kernels a
                    # CUDA graph replays (nothing launched them).
                    group = "pp" if layout_pp > 1 else (replayed_group or "unattributed")
                    desc = "graph-replayed" if group == replayed_group else "p2p"
                elif desc.startswith(HYBRID_CP_PREFIX):  # dynamic CP: "cp2", "cp4", ... by group size
                    group = "cp" + desc[len(HYBRID_CP_PREFIX):]
                    megatron_named = True
                elif desc in GROUP_OF_DESCRIPTION:
                    group = GROUP_OF_DESCRIPTION[desc]
                    megatron_named |= desc != "default_pg"
                else:
                    group = group_by_members(a.get("Process Group Ranks"), planned or {})
                    if group is None:
                        group = desc.lower()
                        unknown.add(desc)
                size = -1  # batched p2p kernels record no message size
                if "dtype" in a:
                    size = DTYPE_BYTES.get(a["dtype"], 0) * max(
                        int(a.get("In msg nelems", 0) or 0), int(a.get("Out msg nelems", 0) or 0))
                collectives.append(Collective(
                    span[0], span[1], collective_kind(name, a.get("Collective name")), group,
                    f"{desc} {a.get('Process Group Ranks', '')} {e.get('args', {}).get('stream', '')}"
                    if desc == "p2p" else f"{desc} {a.get('Process Group Ranks', '')}", size))
            else:
                compute.append(span)
                classed.setdefault(kernel_class(name) if cat == "kernel" else "other", []).append(span)
    if not megatron_named:  # DeepSpeed's own groups: ZeRO-3 gathers over the default group
        for c in collectives:
            desc, _, ranks = c.communicator.partition(" ")
            if desc == "default_pg":
                c.group = group_by_members(ranks, planned or {}) or c.group
    activity.sort(key=lambda a: a[0])
    starts = np.array([a[0] for a in activity], dtype=np.float64)
    launches = np.array([launch_ts.get(c, np.nan) for _, c in activity], dtype=np.float64) if launch_ts else None
    return RankTrace(rank, steps, union(compute), collectives, unknown, starts, launches,
                     {cls: union(spans) for cls, spans in classed.items()})


def host_wait(rt: RankTrace, busy: np.ndarray, lo: float, hi: float) -> float | None:
    """Microseconds of [lo, hi) in which the GPU was idle because nothing had been launched yet.

    For each idle gap, the activity that ends it is the first one starting at or after the
    gap's end; the part of the gap before that activity's launch call is host wait (the
    rest: the work was queued but waited, e.g. on another stream or an event).
    """
    if rt.launches is None:
        return None
    edges = np.concatenate([[lo], busy.reshape(-1), [hi]]).reshape(-1, 2)  # gaps: [end_i, start_i+1]
    out = 0.0
    for g0, g1 in edges:
        if g1 <= g0:
            continue
        k = int(np.searchsorted(rt.starts, g1 - 1e-3, side="left"))
        if k >= len(rt.starts):
            continue  # nothing ran after this gap inside the trace
        same = rt.launches[k:np.searchsorted(rt.starts, rt.starts[k], side="right")]
        if np.all(np.isnan(same)):
            continue  # its launch was not recorded
        out += min(max(np.nanmin(same), g0), g1) - g0
    return out


# Per step -------------------------------------------------------------------
def _breakdown(rt: RankTrace, lo: float, hi: float, wait: dict[int, float]) -> dict:
    """Seconds of compute, communication (per kind and group), exposed and idle in [lo, hi)."""
    compute = clip(rt.compute, lo, hi)
    inside = [i for i, c in enumerate(rt.collectives) if c.end > lo and c.start < hi]
    comm = clip(union([(rt.collectives[i].start, rt.collectives[i].end) for i in inside]), lo, hi)
    overlapped = total(intersect(comm, compute))
    busy_spans = union(np.vstack([compute, comm]))
    busy = total(busy_spans)
    window = hi - lo
    us = 1e-6

    def part(key):
        out = {}
        for name in sorted({getattr(rt.collectives[i], key) for i in inside}):
            members = [rt.collectives[i] for i in inside if getattr(rt.collectives[i], key) == name]
            u = clip(union([(c.start, c.end) for c in members]), lo, hi)
            entry = {
                "comm_s": total(u) * us,
                "exposed_s": (total(u) - total(intersect(u, compute))) * us,
                "calls": len(members),
                "bytes": None if any(c.bytes < 0 for c in members) else int(sum(c.bytes for c in members)),
            }
            if wait:
                idx = [i for i in inside if getattr(rt.collectives[i], key) == name]
                # unmatched calls (point-to-point) have no skew split
                matched = [i for i in idx if i in wait]
                entry["wait_s"] = sum(wait[i] for i in matched) * us if matched else None
            out[name] = entry
        return out

    comm_t = total(comm)
    waited = host_wait(rt, busy_spans, lo, hi)
    rec = {
        "step_s": window * us,
        "compute_s": total(compute) * us,
        "comm_s": comm_t * us,
        "exposed_comm_s": (comm_t - overlapped) * us,
        "idle_s": (window - busy) * us,
        "host_wait_s": None if waited is None else waited * us,
        "gpu_activities": int(((rt.starts >= lo) & (rt.starts < hi)).sum()),
        # No communication at all: nothing to overlap; 0 % rather than an undefined ratio.
        "overlap_pct": 100.0 * overlapped / comm_t if comm_t > 0 else 0.0,
        "compute_by_class_s": {cls: total(clip(u, lo, hi)) * us for cls, u in sorted(rt.compute_classes.items())},
        "by_kind": part("kind"),
        "by_group": part("group"),
    }
    if wait:
        rec["wait_s"] = sum(wait.get(i, 0.0) for i in inside) * us
    return rec


def _skew_waits(traces: dict[int, RankTrace]) -> dict[int, dict[int, float]]:
    """Per rank, per collective index: time spent before the communicator's last member arrived.

    The k-th kernel of a communicator on one rank is the k-th on every member (NCCL runs
    one communicator's operations in order). A communicator whose members' counts differ
    (a member's trace missing) gets no split.
    """
    by_comm: dict[str, dict[int, list[int]]] = {}
    for r, rt in traces.items():
        for i, c in enumerate(rt.collectives):
            by_comm.setdefault(c.communicator, {}).setdefault(r, []).append(i)
    waits: dict[int, dict[int, float]] = {r: {} for r in traces}
    for comm, per_rank in by_comm.items():
        if comm.startswith(("p2p", "graph-replayed")) or len(per_rank) < 2:
            continue  # point-to-point pairs are not matched by count; replayed kernels name no members
        counts = {len(v) for v in per_rank.values()}
        ranks_text = comm.split(" ", 1)[1] if " " in comm else ""
        members = json.loads(ranks_text) if ranks_text.startswith("[") else []
        if len(counts) != 1 or (members and set(members) != set(per_rank)):
            continue
        for k in range(counts.pop()):
            calls = {r: traces[r].collectives[idx[k]] for r, idx in per_rank.items()}
            arrival = max(c.start for c in calls.values())
            for r, idx in per_rank.items():
                c = calls[r]
                waits[r][idx[k]] = min(max(arrival - c.start, 0.0), c.end - c.start)
    return waits


def _mean(records: list[dict]) -> dict:
    """Mean over steps and ranks of every number (nested per kind and group)."""
    def avg(dicts):
        out = {}
        keys = sorted({k for d in dicts for k in d})
        for k in keys:
            vals = [d.get(k) for d in dicts]
            present = [v for v in vals if v is not None]
            # A key that is there but None was not measured (host wait without launch
            # records, bytes of p2p kernels): no mean. A key that is absent is zero (a group
            # with no calls in that step).
            if not present or any(k in d and d[k] is None for d in dicts):
                out[k] = None
            elif isinstance(present[0], dict):
                out[k] = avg([v or {} for v in vals])
            else:
                out[k] = sum(v or 0.0 for v in vals) / len(dicts)
        return out
    return avg(records)


def graph_replayed_group(job_dir: Path, layout: dict) -> str | None:
    """The group of the NCCL kernels a run's CUDA graphs replay, or None. A replayed kernel
    was never launched, so the trace has no process-group record for it (nor a size: its
    group's bytes are unknown, and it takes no part in the skew split); per-layer graphs
    (engine.cuda_graphs=layers) capture only a layer's own collectives, which with the
    refusals of megatron_rules (no MoE) are TP's or CP's: the one of the two with more
    than one rank. With both, nothing is assumed; with pipeline stages the unnamed kernels
    stay PP's, as without graphs (the two cannot be told apart)."""
    from ..runtime.jobdir import CONFIG_FILE, load_job_config

    if layout["pp"] > 1 or not (job_dir / CONFIG_FILE).is_file():
        return None
    if load_job_config(job_dir).engine.cuda_graphs == "none":
        return None
    inside = [kind for kind in ("tp", "cp") if layout[kind] > 1]
    return inside[0] if len(inside) == 1 else None


def analyze(job_dir: Path) -> dict:
    """The communication record of a job (written to communication.json by the worker)."""
    job_dir = Path(job_dir)
    if not (job_dir / "placement.json").is_file():
        raise TraceError(f"{job_dir} is not a job directory (no placement.json) and has no traces")
    placement = json.loads((job_dir / "placement.json").read_text())
    layout = placement["layout"]
    files = sorted((job_dir / TRACES_DIR).glob("rank_*.json.gz"))
    if not files:
        raise TraceError(f"{job_dir}: no traces in {TRACES_DIR}/ (run with evaluate.profile_steps=[first,last])")
    traces, replayed = {}, graph_replayed_group(job_dir, layout)
    for f in files:
        rank = _rank_of_file(f)
        rt = load_rank_trace(f, layout["pp"], planned_groups(placement, rank) if rank < len(placement["ranks"]) else None,
                             replayed)
        traces[rt.rank] = rt
    if not any(len(rt.compute) or rt.collectives for rt in traces.values()):
        return {
            "available": False,
            "reason": "the traces hold no GPU kernels (a CPU/gloo run: collectives block the host "
                      "thread and there is no device timeline to overlap), so compute, exposed "
                      "communication and overlap are not measured",
            "ranks_traced": sorted(traces),
        }
    waits = _skew_waits(traces) if len(traces) == layout["world_size"] else {}
    timers = {}
    for r in traces:
        p = step_times_path(job_dir, r)
        if p.exists():
            timers[r] = {int(k): v for k, v in json.loads(p.read_text()).items()}
    per_rank, mismatches = {}, []
    for r, rt in sorted(traces.items()):
        steps = {}
        for step, (lo, hi) in sorted(rt.steps.items()):
            rec = _breakdown(rt, lo, hi, waits.get(r, {}))
            if r in timers and step in timers[r]:
                rec["timer_step_s"] = timers[r][step]
                parts = rec["compute_s"] + rec["exposed_comm_s"] + rec["idle_s"]
                rec["closure_error"] = abs(parts - rec["timer_step_s"]) / rec["timer_step_s"]
            steps[step] = rec
        per_rank[r] = steps
        mismatches += _group_mismatches(rt, placement)
    all_records = [rec for steps in per_rank.values() for rec in steps.values()]
    doc = {
        "available": True,
        "definition": "compute/communication/exposed/idle seconds per step; overlap % = "
                      "communication overlapped with compute / communication (HTA)",
        "ranks_traced": sorted(traces),
        "ranks_missing": sorted(set(range(layout["world_size"])) - set(traces)),
        "steps": sorted({s for steps in per_rank.values() for s in steps}),
        "skew_split": bool(waits),
        "mean": _mean(all_records),
        "stragglers": _stragglers(per_rank),
        "compute_imbalance": _compute_imbalance(per_rank),
        "group_check": mismatches or "every attributed communicator's ranks equal the planned group",
        "unknown_groups": sorted(set().union(*(rt.unknown_groups for rt in traces.values()))),
        "ranks": {str(r): {str(s): rec for s, rec in steps.items()} for r, steps in per_rank.items()},
    }
    closures = [rec["closure_error"] for rec in all_records if "closure_error" in rec]
    if closures:
        doc["max_closure_error"] = max(closures)
    return doc


def _rank_of_file(path: Path) -> int:
    return int(re.findall(r"\d+", path.name)[0])


def _group_mismatches(rt: RankTrace, placement: dict) -> list[str]:
    """Communicators whose members differ from the planned group of the same kind."""
    rec = placement["ranks"][rt.rank]
    out = set()
    for c in rt.collectives:
        desc, _, ranks = c.communicator.partition(" ")
        kind = PLACEMENT_KIND_OF_DESCRIPTION.get(desc)
        if kind is None or not ranks.startswith("["):
            continue
        planned = placement["groups"][kind][rec["group_ids"][kind]]
        if json.loads(ranks) != planned:
            out.add(f"rank {rt.rank}: {desc} has ranks {ranks}, planned {kind} group {planned}")
    return sorted(out)


def _stragglers(per_rank: dict[int, dict[int, dict]]) -> list[dict]:
    """Per step: the rank with the longest step and how far behind the fastest it is."""
    out = []
    steps = sorted({s for steps in per_rank.values() for s in steps})
    for s in steps:
        times = {r: steps_[s]["step_s"] for r, steps_ in per_rank.items() if s in steps_}
        busy = {r: per_rank[r][s]["compute_s"] for r in times}
        slow, fast = max(times, key=times.get), min(times, key=times.get)
        out.append({
            "step": s,
            "slowest_rank": slow,
            "behind_s": times[slow] - times[fast],
            "behind_pct": 100.0 * (times[slow] - times[fast]) / times[fast],
            # the rank the others wait for: the most compute in the step
            "busiest_rank": max(busy, key=busy.get),
        })
    return out


def _compute_imbalance(per_rank: dict[int, dict[int, dict]]) -> float | None:
    """Per-rank work imbalance: the busiest rank's GPU compute over the mean rank's, per
    traced step, averaged (1.0: every rank computes as long; the others wait the rest)."""
    ratios = []
    for s in sorted({s for steps in per_rank.values() for s in steps}):
        busy = [steps[s]["compute_s"] for steps in per_rank.values() if s in steps]
        mean = sum(busy) / len(busy)
        if len(busy) > 1 and mean > 0:
            ratios.append(max(busy) / mean)
    return sum(ratios) / len(ratios) if ratios else None


def summary_of(doc: dict) -> dict:
    """The few numbers a run's summary and the sweep table carry."""
    if not doc.get("available"):
        return {"available": False, "reason": doc.get("reason")}
    m = doc["mean"]
    keys = ("step_s", "compute_s", "comm_s", "exposed_comm_s", "idle_s", "host_wait_s", "gpu_activities",
            "overlap_pct", "wait_s")
    out = {k: m[k] for k in keys if k in m}
    out["compute_by_class_s"] = m.get("compute_by_class_s") or {}
    out["by_group"] = {g: {k: v for k, v in rec.items() if k in ("comm_s", "exposed_s", "wait_s", "bytes")}
                       for g, rec in m.get("by_group", {}).items()}
    out["max_closure_error"] = doc.get("max_closure_error")
    out["compute_imbalance"] = doc.get("compute_imbalance")
    return out


def format_report(doc: dict) -> str:
    """A terminal table: the mean step per rank, then per group, then stragglers."""
    if not doc.get("available"):
        return f"communication: not measured: {doc['reason']}"
    ms = 1e3
    lines = ["rank  step ms  compute  exposed comm  idle  host wait  overlap  (ms; mean of traced steps)"]
    for r, steps in doc["ranks"].items():
        m = _mean(list(steps.values()))
        waited = "n/a" if m.get("host_wait_s") is None else f"{m['host_wait_s'] * ms:.1f}"
        lines.append(f"{r:>4} {m['step_s'] * ms:8.1f} {m['compute_s'] * ms:8.1f} {m['exposed_comm_s'] * ms:12.1f}"
                     f" {m['idle_s'] * ms:6.1f} {waited:>10} {m['overlap_pct']:7.1f} %")
    classes = doc["mean"].get("compute_by_class_s") or {}
    if classes:
        lines.append("compute by class (ms, mean over ranks): "
                     + ", ".join(f"{cls} {v * ms:.1f}" for cls, v in classes.items()))
    lines.append("group  comm ms  exposed ms  wait ms  MB/step   (mean over ranks)")
    for g, rec in doc["mean"]["by_group"].items():
        wait = f"{rec['wait_s'] * ms:8.1f}" if rec.get("wait_s") is not None else "     n/a"
        size = f"{rec['bytes'] / 1e6:8.1f}" if rec.get("bytes") is not None else "     n/a"
        lines.append(f"{g:>5} {rec['comm_s'] * ms:8.1f} {rec['exposed_s'] * ms:11.1f} {wait} {size}")
    worst = max(doc["stragglers"], key=lambda s: s["behind_s"]) if doc["stragglers"] else None
    if worst:
        lines.append(f"straggler: step {worst['step']} rank {worst['slowest_rank']} "
                     f"{worst['behind_s'] * ms:.2f} ms ({worst['behind_pct']:.1f} %) behind the fastest; "
                     f"busiest rank {worst['busiest_rank']}")
    return "\n".join(lines)
