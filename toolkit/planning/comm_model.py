"""The alpha-beta model of collectives, and the communication of one Megatron training step.

Conventions are nccl-tests' (nccl-tests/doc/PERFORMANCE.md), so that numbers compare with
its tables:

* message size: the buffer bytes nccl-tests reports. all_reduce: the buffer; all_gather:
  the total output (n x each rank's input); reduce_scatter: the total input; all_to_all:
  the total bytes each rank sends (its own slice included); send_recv: the bytes sent.
* algorithm bandwidth = size / time; bus bandwidth = algorithm bandwidth x bus factor,
  with bus factors all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n,
  send_recv 1. Bus bandwidth is what a link carries, so it is comparable across n.
* one collective takes t = alpha + beta x size x bus_factor(n): alpha the latency (s),
  beta the seconds per bus byte, 1/beta the bus bandwidth.

A `CommProfile` holds fits measured by `python -m gridwright.evaluations.bench_collectives`,
and `predict_step_communication` lists every collective of one training step of the
Megatron engine, in bytes and (with a profile) seconds. Planning imports this module, so
it imports numpy and gridwright's config-level modules only; torch and matplotlib are not
imported here (matplotlib lazily, inside `plot_profile`).
"""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..basics.atomic_io import write_text_atomic
from .layout import ParallelLayout, cp_exchange
from .model_math import ParamCounts, param_counts

FORMAT = "gridwright-comm-profile/1"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# Megatron-Core 0.16.1 DDP default bucket (elements): max(40M, 1M x DP), DP without CP
# (distributed_data_parallel.py, from `dp_group`, which is get_data_parallel_group(
# with_context_parallel=False)).
BUCKET_FLOOR_ELEMENTS = 40_000_000
BUCKET_PER_DP_RANK_ELEMENTS = 1_000_000


# Bandwidth arithmetic ----------------------------------------------------------------------
def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of `collective` over `n` ranks."""
    if n < 1:
        raise ValueError(f"group size must be at least 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective '{collective}'; known: {', '.join(COLLECTIVES)}")


def alg_bandwidth(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: message size (nccl-tests convention) over time."""
    return size_bytes / seconds


def bus_bandwidth(collective: str, n: int, size_bytes: float, seconds: float) -> float:
    """Bus bandwidth in bytes/s: algorithm bandwidth x bus factor."""
    return alg_bandwidth(size_bytes, seconds) * bus_factor(collective, n)


# The fit -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlphaBetaFit:
    """t = alpha_s + beta_s_per_byte x size x bus_factor(collective, group_size)."""

    collective: str
    group_size: int
    alpha_s: float  # latency, seconds
    beta_s_per_byte: float  # seconds per bus byte; 1/beta is the bus bandwidth
    rms_rel_error: float  # root-mean-square of (predicted - measured) / measured
    num_points: int = 0

    def seconds(self, size_bytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * size_bytes * bus_factor(self.collective, self.group_size)

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte

    def to_dict(self) -> dict:
        bw = self.bus_bandwidth_bytes_per_s
        return {
            "alpha_s": self.alpha_s,
            "beta_s_per_byte": self.beta_s_per_byte,
            "rms_rel_error": self.rms_rel_error,
            "num_points": self.num_points,
            # For readers of the file; recomputed from beta on load.
            "bus_bandwidth_GBps": None if math.isinf(bw) else bw / 1e9,
        }

    @classmethod
    def from_dict(cls, collective: str, group_size: int, d: dict) -> "AlphaBetaFit":
        return cls(
            collective=collective,
            group_size=int(group_size),
            alpha_s=float(d["alpha_s"]),
            beta_s_per_byte=float(d["beta_s_per_byte"]),
            rms_rel_error=float(d["rms_rel_error"]),
            num_points=int(d.get("num_points", 0)),
        )


def fit_alpha_beta(sizes_bytes, seconds, collective: str, n: int) -> AlphaBetaFit:
    """Fit t = alpha + beta x size x bus_factor by least squares in relative error.

    Minimises sum(((alpha + beta x_i - t_i) / t_i)^2) with x_i = size_i x bus_factor, i.e.
    ordinary least squares on the rows (1/t_i, x_i/t_i) -> 1 (weights 1/t_i). An unweighted
    fit would be decided by the largest messages alone (their times are 10^4 x larger) and
    could miss the latency by orders of magnitude; in relative error a 1 KiB point counts
    as much as a 1 GiB one.

    Both parameters are physical only when non-negative. A negative alpha comes out when
    the small sizes run in a faster regime than the line through the large ones (NCCL's
    LL/LL128 protocols versus Simple), a negative beta when the measured range never
    leaves the latency-bound regime. The objective is a convex quadratic, so its minimum
    over alpha >= 0, beta >= 0 is the unconstrained one when that is feasible, else the
    better of the two one-parameter fits on the edges (alpha = 0: best bandwidth-only
    line; beta = 0: best constant). The clamped fit never predicts a negative time.
    """
    x = np.asarray(sizes_bytes, dtype=np.float64) * bus_factor(collective, n)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(f"sizes and seconds must be 1-D of equal length, got {x.shape} and {t.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"an alpha-beta fit needs at least two distinct sizes, got {len(np.unique(x))}")
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("every measured time must be positive and finite")
    w = 1.0 / t
    a_col, b_col = w, w * x  # relative residual = alpha * a_col + beta * b_col - 1

    def rel_residuals(alpha: float, beta: float) -> np.ndarray:
        return alpha * a_col + beta * b_col - 1.0

    scale = float(np.max(np.abs(b_col)))  # conditioning: beta's column spans ~10^6
    design = np.stack([a_col, b_col / scale], axis=1)
    (alpha0, beta_scaled), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    candidates = []
    if alpha0 >= 0 and beta_scaled >= 0:
        candidates.append((float(alpha0), float(beta_scaled / scale)))
    else:
        candidates.append((0.0, float(np.sum(b_col) / np.sum(b_col * b_col))))  # alpha = 0
        candidates.append((float(np.sum(a_col) / np.sum(a_col * a_col)), 0.0))  # beta = 0
    alpha, beta = min(candidates, key=lambda ab: float(np.sum(rel_residuals(*ab) ** 2)))
    rms = float(np.sqrt(np.mean(rel_residuals(alpha, beta) ** 2)))
    return AlphaBetaFit(collective, int(n), alpha, beta, rms, num_points=len(t))


# The profile -------------------------------------------------------------------------------
class UnmeasuredGroupSize(LookupError):
    """A prediction asked for a (collective, group size) the profile has no fit for."""

    def __init__(self, collective: str, group_size: int, measured: list[int], path=None):
        self.collective, self.group_size, self.measured = collective, group_size, measured
        where = f" {path}" if path else ""
        sizes = ", ".join(map(str, measured)) or "none"
        super().__init__(
            f"the communication profile{where} has no {collective} fit for groups of "
            f"{group_size} ranks (measured group sizes: {sizes}). Fix: rerun "
            "`torchrun --nproc_per_node N -m gridwright.evaluations.bench_collectives` with this "
            "job's --job-dir, or on at least as many ranks."
        )


Points = dict  # collective -> {group_size: [(size_bytes, seconds), ...]}
Fits = dict  # collective -> {group_size: AlphaBetaFit}


def fit_points(points: Points) -> Fits:
    return {
        coll: {n: fit_alpha_beta([p[0] for p in pts], [p[1] for p in pts], coll, n) for n, pts in by_n.items()}
        for coll, by_n in points.items()
    }


@dataclass
class KindMeasurement:
    """One placement group kind (tp, dp_cp, ...) measured on its own groups."""

    group_size: int
    num_groups: int
    points: Points
    fits: Fits


@dataclass
class CommProfile:
    """Measured collective times and their alpha-beta fits on one cluster.

    `points` and `fits` are keyed by collective, then by group size. With --job-dir the
    benchmark also keeps each placement kind's own measurement in `kinds` (a TP group
    inside a node and a DP group across nodes of the same size differ); the size-keyed
    table then holds, per collective and size, the kind whose fit is slowest at the
    largest measured message, so a lookup by size alone is never optimistic.
    """

    device: str
    backend: str
    world_size: int
    points: Points
    fits: Fits
    kinds: dict = field(default_factory=dict)  # kind -> KindMeasurement
    meta: dict = field(default_factory=dict)  # created, source, iters, warmup, ...
    path: str | None = None  # where it was loaded from (for messages)

    # Lookup -------------------------------------------------------------------------
    def group_sizes(self, collective: str) -> list[int]:
        return sorted(self.fits.get(collective, {}))

    def fit(self, collective: str, group_size: int, kind: str | None = None) -> AlphaBetaFit:
        """The fit of `kind` when measured at this size, else the size-keyed one."""
        bus_factor(collective, max(group_size, 1))  # rejects unknown collectives
        km = self.kinds.get(kind) if kind else None
        if km is not None and km.group_size == group_size and collective in km.fits:
            return km.fits[collective][group_size]
        try:
            return self.fits[collective][group_size]
        except KeyError:
            raise UnmeasuredGroupSize(collective, group_size, self.group_sizes(collective), self.path) from None

    def seconds(self, collective: str, group_size: int, size_bytes: float, kind: str | None = None) -> float:
        """Predicted time of one call; raises UnmeasuredGroupSize for an unmeasured size."""
        return self.fit(collective, group_size, kind).seconds(size_bytes)

    # Building -----------------------------------------------------------------------
    @classmethod
    def from_points(cls, device: str, backend: str, world_size: int, points: Points,
                    kinds: dict | None = None, meta: dict | None = None) -> "CommProfile":
        """Fit every (collective, group size); `kinds`: kind -> (group_size, num_groups, points).

        Without `points` (job-dir mode) the size-keyed table is built from the kinds.
        """
        measured = {
            k: KindMeasurement(int(n), int(g), pts, fit_points(pts)) for k, (n, g, pts) in (kinds or {}).items()
        }
        points = {c: dict(v) for c, v in (points or {}).items()}
        fits = fit_points(points)
        chosen = {}  # (collective, size) -> (kind, fit, points), for sizes only kinds measured
        for kind, km in measured.items():
            n = km.group_size
            for coll, by_n in km.fits.items():
                if n in fits.get(coll, {}):
                    continue  # measured directly by size
                largest = max(p[0] for p in km.points[coll][n])
                old = chosen.get((coll, n))
                if old is None or by_n[n].seconds(largest) > old[1].seconds(largest):
                    chosen[(coll, n)] = (kind, by_n[n], km.points[coll][n])
        meta = dict(meta or {})
        for (coll, n), (kind, fit, pts) in chosen.items():
            fits.setdefault(coll, {})[n] = fit
            points.setdefault(coll, {})[n] = pts
            meta.setdefault("size_table_from", {}).setdefault(coll, {})[str(n)] = kind
        return cls(device, backend, int(world_size), points, fits, measured, meta)

    # File format --------------------------------------------------------------------
    def to_dict(self) -> dict:
        def pts(p: Points) -> dict:
            return {c: {str(n): [[int(s), float(t)] for s, t in v] for n, v in sorted(by.items())}
                    for c, by in p.items()}

        def fts(f: Fits) -> dict:
            return {c: {str(n): fit.to_dict() for n, fit in sorted(by.items())} for c, by in f.items()}

        return {
            "format": FORMAT,
            "device": self.device,
            "backend": self.backend,
            "world_size": self.world_size,
            "meta": self.meta,
            "points": pts(self.points),
            "fits": fts(self.fits),
            "kinds": {
                k: {"group_size": km.group_size, "num_groups": km.num_groups,
                    "points": pts(km.points), "fits": fts(km.fits)}
                for k, km in self.kinds.items()
            },
        }

    @classmethod
    def from_dict(cls, doc: dict, path=None) -> "CommProfile":
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path or 'profile'}: format is {doc.get('format')!r}, expected {FORMAT!r}")

        def pts(d: dict) -> Points:
            return {c: {int(n): [(int(s), float(t)) for s, t in v] for n, v in by.items()} for c, by in d.items()}

        def fts(d: dict) -> Fits:
            return {c: {int(n): AlphaBetaFit.from_dict(c, int(n), f) for n, f in by.items()}
                    for c, by in d.items()}

        kinds = {
            k: KindMeasurement(int(v["group_size"]), int(v["num_groups"]), pts(v["points"]), fts(v["fits"]))
            for k, v in doc.get("kinds", {}).items()
        }
        return cls(
            device=str(doc["device"]), backend=str(doc["backend"]), world_size=int(doc["world_size"]),
            points=pts(doc["points"]), fits=fts(doc["fits"]), kinds=kinds,
            meta=dict(doc.get("meta", {})), path=None if path is None else str(path),
        )

    def save(self, path) -> Path:
        """Write atomically (a reader sees the old file or the new one)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "CommProfile":
        return cls.from_dict(json.loads(Path(path).read_text()), path=path)


def new_meta(**extra) -> dict:
    return {"created": datetime.datetime.now().isoformat(timespec="seconds"), **extra}


def plot_profile(profile: CommProfile, path_png) -> Path:
    """Measured points and fitted lines, log-log, one panel per collective, one colour per
    group size (matplotlib, imported here so planning never loads it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = [c for c in COLLECTIVES if profile.points.get(c)]
    cols = min(3, max(len(colls), 1))
    rows = max(1, math.ceil(len(colls) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.9 * rows), squeeze=False)
    for ax in axes.flat[len(colls):]:
        ax.set_visible(False)
    for ax, coll in zip(axes.flat, colls):
        for i, (n, pts) in enumerate(sorted(profile.points[coll].items())):
            sizes = np.array([p[0] for p in pts], dtype=float)
            times = np.array([p[1] for p in pts], dtype=float)
            colour = f"C{i % 10}"
            fit = profile.fits[coll][n]
            ax.loglog(sizes, times * 1e6, "o", ms=3.5, color=colour)
            line = np.geomspace(sizes.min(), sizes.max(), 64)
            label = f"n={n}: α={fit.alpha_s * 1e6:.1f} µs, {fit.bus_bandwidth_bytes_per_s / 1e9:.1f} GB/s"
            ax.loglog(line, np.array([fit.seconds(s) for s in line]) * 1e6, "-", lw=1.2, color=colour, label=label)
        ax.set_title(coll)
        ax.set_xlabel("message size (bytes, nccl-tests)")
        ax.set_ylabel("time (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{profile.device} ({profile.backend}, {profile.world_size} ranks)", fontsize=10)
    fig.tight_layout()
    path_png = Path(path_png)
    path_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return path_png


# Communication of one training step --------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    """The quantities every term below is built from (one rank of the first stage), read
    from the config once by `predict_step_communication`: the terms see only these."""

    s: int  # sequence length
    s_cp: int  # sequence per CP rank: s / cp
    s_pipe: int  # sequence of a pipeline/MoE-input activation: s / cp, / tp under SP
    b: int  # micro-batch size
    h: int
    act: int  # activation bytes: 2 for bf16/fp16 params, else 4
    param_bytes: int  # bytes of a parameter (distributed optimizer's all-gather)
    micro: int  # micro-batches per step: global batch / (micro batch x DP)
    layers: int  # transformer layers of this stage (all virtual chunks)
    last_stage: bool  # the first stage is also the last (pp == 1)
    moe: bool
    params: ParamCounts  # the whole model's parameter counts
    model: Any  # the model group (heads, query groups, experts, tied embeddings)
    recompute: str  # train.recompute
    zero_stage: int
    vpp: int  # model chunks per rank (parallel.vpp, 1 without VPP)
    bucket_size: int | None  # engine.bucket_size (Megatron-FSDP's bucket outside the layers)
    ddp_bucket: int | None  # DDP's bucket in elements (`_bucket_elements`); None: one bucket
    dispatcher: str  # parallel.moe_token_dispatcher
    cp_comm_type: str = "all_gather"  # parallel.cp_comm_type


class _Calls:
    """Accumulates calls; the same (collective, size, what, group size) adds up its count."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.items: dict = {}

    def add(self, collective: str, size_bytes: int, count: int, what: str, group_size: int | None = None):
        if count <= 0 or size_bytes <= 0:
            return
        key = (collective, int(size_bytes), what, group_size or self.group_size)
        self.items[key] = self.items.get(key, 0) + int(count)

    def as_list(self) -> list[dict]:
        return [
            {"collective": c, "size_bytes": s, "count": n, "what": w, "group_size": g}
            for (c, s, w, g), n in self.items.items()
        ]


def _tp_calls(layout: ParallelLayout, st: _Step) -> list[dict]:
    """Tensor parallelism (group tp), per layer per micro-batch unless said otherwise.

    A = s/cp x b x h x act bytes (the full sequence of this CP rank). A dense layer has
    two column-parallel linears (QKV, FC1) and two row-parallel ones (attention
    projection, FC2); an MoE layer only the attention pair (its experts talk through the
    token dispatcher, and Megatron-Core refuses MoE with TP but without SP).
    * without SP: forward one all_reduce of A after each row-parallel linear; backward one
      all_reduce of A (the input gradient) for each column-parallel linear.
    * with SP (megatron/core/tensor_parallel/layers.py,
      LinearWithGradAccumulationAndAsyncCommunication): forward an all_gather of A before
      each column-parallel linear and a reduce_scatter of A after each row-parallel one;
      backward, per column-parallel linear, the SP input is all-gathered AGAIN (the
      forward does not keep the gathered input; `backward` re-runs dist_all_gather_func
      on the saved shard for the weight gradient) and the input gradient is
      reduce-scattered; per row-parallel linear, the backward of the reduce-scatter is an
      all_gather of the output gradient. Dense layer: forward 2 AG + 2 RS, backward
      4 AG + 2 RS.
    * full recompute repeats each layer's forward collectives in the backward.
    * embedding (first stage), per micro-batch: without SP a forward all_reduce of A
      (VocabParallelEmbedding, reduce_from_tensor_model_parallel_region); with SP a forward
      reduce_scatter of A and its backward all_gather (reduce_scatter_embeddings).
    * when this stage is also the last (pp == 1), per micro-batch: the output layer is a
      column-parallel linear (without SP: backward all_reduce of A; with SP: forward AG,
      backward AG + RS); the vocab-parallel cross-entropy's forward does 3 all_reduces of
      s/cp x b fp32 values (max logit, target logit, sum of exps;
      tensor_parallel/cross_entropy.py, unfused, Megatron's default).
    * MoE aux loss (moe_aux_loss_coeff > 0): per MoE layer per micro-batch a forward
      all_reduce of the tokens-per-expert counts (E int64; router.py,
      get_tokens_per_expert_and_token_count) over the tp x cp group, listed here with that
      group size (under cp when tp == 1).
    * with SP, once per step: finalize_model_grads all-reduces the gradients of the
      weights every TP rank holds whole (norms, router) in fp32, one coalesced call:
      2h per layer (+ h for the final norm on the last stage) + h x experts per MoE layer.
    """
    tp = layout.tp
    if tp == 1:
        return []
    c = _Calls(tp)
    m = st.model
    A = st.s_cp * st.b * st.h * st.act
    per = st.layers * st.micro
    pairs = 1 if st.moe else 2  # column-parallel (and row-parallel) linears per layer
    col = "QKV" if st.moe else "QKV and FC1"
    row = "attention projection" if st.moe else "attention projection and FC2"
    if layout.sp:
        forward = [("all_gather", f"SP all-gather before {col}"),
                   ("reduce_scatter", f"SP reduce-scatter after {row}")]
        backward = [("all_gather", f"SP re-gather of the {col} input for the weight gradient"),
                    ("reduce_scatter", f"SP reduce-scatter of the {col} input gradient"),
                    ("all_gather", f"SP all-gather of the {row} output gradient")]
    else:
        forward = [("all_reduce", f"all-reduce after {row}")]
        backward = [("all_reduce", f"all-reduce of the {col} input gradient")]
    for coll, what in forward:
        c.add(coll, A, pairs * per, f"{what}, forward")
    for coll, what in backward:
        c.add(coll, A, pairs * per, f"{what}, backward")
    if st.recompute == "full":
        for coll, what in forward:
            c.add(coll, A, pairs * per, f"{what}, recomputed in backward")
    if layout.sp:
        c.add("reduce_scatter", A, st.micro, "SP reduce-scatter of the embedding output, forward")
        c.add("all_gather", A, st.micro, "SP all-gather of the embedding output gradient, backward")
    else:
        c.add("all_reduce", A, st.micro, "all-reduce of the vocab-parallel embedding output, forward")
    if st.last_stage:
        if layout.sp:
            c.add("all_gather", A, st.micro, "SP all-gather before the output layer, forward")
            c.add("all_gather", A, st.micro, "SP re-gather of the output layer input, backward")
            c.add("reduce_scatter", A, st.micro, "SP reduce-scatter of the output layer input gradient, backward")
        else:
            c.add("all_reduce", A, st.micro, "all-reduce of the output layer input gradient, backward")
        c.add("all_reduce", st.s_cp * st.b * 4, 3 * st.micro,
              "vocab-parallel cross-entropy (max, target, sum-exp; fp32), forward")
    if st.moe and m.moe_aux_loss_coeff > 0:  # over tp x cp: Megatron's TENSOR_AND_CONTEXT group
        c.add("all_reduce", int(m.num_experts) * 8, per, "MoE aux-loss tokens-per-expert all-reduce, forward",
              group_size=tp * layout.cp)
    if layout.sp:
        replicated = st.layers * (2 * st.h + (st.h * int(m.num_experts) if st.moe else 0))
        replicated += st.h if st.last_stage else 0
        c.add("all_reduce", 4 * replicated, 1, "SP gradients of norm/router weights (fp32), once per step")
    return c.as_list()


def _cp_calls(layout: ParallelLayout, st: _Step) -> list[dict]:
    """Context parallelism (group cp) as the torch-native engine path does it
    (megatron_model.SDPACoreAttention), per layer per micro-batch:
    * all-gather form (torch_attention.context_parallel): forward one all_gather each of K
      and V, total output KV = s x b x (num_query_groups / tp) x head_dim x act; backward
      `_GatherSequence.backward` all-reduces each whole gathered gradient (KV bytes; gloo
      has no reduce_scatter there) and keeps its slice.
    * all-to-all form (torch_attention.context_parallel_a2a): forward one all_to_all of
      this rank's Q, K and V together (s/cp x b x (heads + 2 groups) / tp x head_dim x act
      sent) and one of the output (s/cp x b x heads / tp x head_dim x act); backward the
      same two, on the gradients.
    Recompute (selective: core attention; full: the layer) repeats the forward's calls in
    the backward. With the loss on this stage (pp == 1), per micro-batch one all_reduce of
    the token count (one fp32); with MoE and tp == 1, the aux loss's tokens-per-expert
    all_reduce (see `_tp_calls`). TE's ring attention (GPUs with TE) is p2p instead and is
    not modelled.
    """
    cp = layout.cp
    if cp == 1:
        return []
    c = _Calls(cp)
    m = st.model
    head_dim = m.get("head_dim") or st.h // int(m.num_attention_heads)
    per = st.layers * st.micro
    # (collective, bytes, calls per layer pass, what): the forward's, then the backward's
    if st.cp_comm_type == "a2a":
        heads, groups = int(m.num_attention_heads) // layout.tp, int(m.num_query_groups) // layout.tp
        qkv = st.s_cp * st.b * (heads + 2 * groups) * head_dim * st.act
        out = st.s_cp * st.b * heads * head_dim * st.act
        forward = [("all_to_all", qkv, 1, "CP all-to-all of Q, K and V"),
                   ("all_to_all", out, 1, "CP all-to-all of the attention output")]
        backward = [("all_to_all", out, 1, "CP all-to-all of the output's gradient"),
                    ("all_to_all", qkv, 1, "CP all-to-all of the Q, K and V gradients")]
    else:
        kv = st.s * st.b * (int(m.num_query_groups) // layout.tp) * head_dim * st.act
        forward = [("all_gather", kv, 2, "CP all-gather of K and V")]
        backward = [("all_reduce", kv, 2, "CP all-reduce of the K and V gradients")]
    recomputed = forward if st.recompute in ("selective", "full") else []
    for calls, when in ((forward, "forward"), (backward, "backward"), (recomputed, "recomputed in backward")):
        for collective, size, count, what in calls:
            c.add(collective, size, count * per, f"{what}, {when}")
    if st.moe and m.moe_aux_loss_coeff > 0 and layout.tp == 1:
        c.add("all_reduce", int(m.num_experts) * 8, per, "MoE aux-loss tokens-per-expert all-reduce, forward")
    if st.last_stage:
        c.add("all_reduce", 4, st.micro, "loss token count, forward")
    return c.as_list()


def _stage_params(layout: ParallelLayout, st: _Step) -> tuple[list[int], list[int], int]:
    """Parameters one rank of the first stage holds: (dense per layer [for each layer],
    experts per layer [for each layer], dense outside the layers).

    Column/row-parallel weights (QKV, projection, MLP, QKV bias) and the vocab-parallel
    embedding and output layer are split over TP; norms and the router are whole on
    every TP rank; experts are split over EP x expert-TP and get their own buffer (over
    the expert-DP group) only when EP > 1: Megatron-Core marks expert weights
    `allreduce=False` only under expert parallelism (tensor_parallel/layers.py,
    moe/experts.py), so with EP = 1 they join the dense buffer. The first stage holds the
    embedding, and with pp == 1 also the final norm and the (untied) output layer.
    """
    m, pc = st.model, st.params
    tp, h = layout.tp, int(m.hidden_size)
    head_dim = m.get("head_dim") or h // int(m.num_attention_heads)
    qkv_bias = (int(m.num_attention_heads) + 2 * int(m.num_query_groups)) * head_dim if m.qkv_bias else 0
    layers = int(m.num_layers) // layout.pp
    dense_layer = (pc.attention_per_layer + pc.dense_mlp_per_layer + qkv_bias) // tp + 2 * h + pc.router_per_layer
    expert_layer = pc.expert_per_layer // (layout.ep * layout.etp)
    if layout.ep == 1:  # experts are then ordinary DDP parameters (allreduce=True)
        dense_layer, expert_layer = dense_layer + expert_layer, 0
    outside = pc.embedding // tp
    if layout.pp == 1:
        outside += h + pc.output // tp
    return [dense_layer] * layers, [expert_layer] * layers if expert_layer else [], outside


def _buckets(elements: int, bucket: int | None) -> list[int]:
    """Split a buffer into buckets of `bucket` elements (None: one bucket)."""
    if elements <= 0:
        return []
    if not bucket or bucket >= elements:
        return [elements]
    full, rest = divmod(elements, bucket)
    return [bucket] * full + ([rest] if rest else [])


def _grad_sync(c: _Calls, st: _Step, layer_params: list[int], outside: int, label: str) -> None:
    """One buffer's data-parallel traffic (see `_dp_calls`)."""
    stage, vpp = st.zero_stage, st.vpp
    if stage == 3:  # Megatron-FSDP: one unit per layer, the rest in one bucket (or bucket_size)
        units = list(layer_params) + _buckets(outside, st.bucket_size)
        for elems in units:
            c.add("all_gather", elems * st.param_bytes, st.micro, f"FSDP {label} parameter all-gather, forward")
            c.add("all_gather", elems * st.param_bytes, st.micro, f"FSDP {label} parameter all-gather, backward")
            c.add("reduce_scatter", elems * 4, st.micro, f"FSDP {label} gradient reduce-scatter (fp32), backward")
        return
    # DDP: one buffer per model chunk; chunk 0 is bucketed, later chunks are one bucket
    # each (disable_bucketing=i > 0); layers are spread evenly over the chunks.
    per_chunk = len(layer_params) // vpp
    chunks = [sum(layer_params[i * per_chunk:(i + 1) * per_chunk]) for i in range(vpp)]
    chunks[0] += outside
    buckets = _buckets(chunks[0], st.ddp_bucket) + [e for e in chunks[1:] if e]
    for elems in buckets:
        if stage == 0:
            c.add("all_reduce", elems * 4, 1, f"{label} gradient all-reduce (fp32), per bucket")
        else:
            c.add("reduce_scatter", elems * 4, 1, f"{label} gradient reduce-scatter (fp32), per bucket")
            c.add("all_gather", elems * st.param_bytes, 1, f"{label} updated-parameter all-gather, per bucket")


def _bucket_elements(engine, layout: ParallelLayout) -> int | None:
    """Megatron-Core 0.16.1 DDP: engine.bucket_size or max(40M, 1M x DP) elements, but only
    when overlap_grad_reduce is on; without it `bucket_size` is set to None (one bucket)."""
    if not engine.overlap_grad_reduce:
        return None
    if engine.bucket_size:
        return int(engine.bucket_size)
    return max(BUCKET_FLOOR_ELEMENTS, BUCKET_PER_DP_RANK_ELEMENTS * layout.dp)


def _dp_calls(layout: ParallelLayout, st: _Step) -> list[dict]:
    """Data parallelism of the dense parameters (Megatron's data-parallel group with CP,
    placement kind dp_cp), per step.

    The gradient buffer holds this rank's dense parameters (`_stage_params`); gradients are
    reduced in fp32 (grad_reduce_in_fp32=True, 4 bytes each). zero.stage 0: one all_reduce
    per bucket. Stages 1-2 (distributed optimizer): a reduce_scatter per bucket (fp32) and
    after the step an all_gather per bucket of the updated parameters (params dtype).
    Buckets (`_bucket_elements`): with overlap_grad_reduce off, the whole buffer is one
    bucket; with it, full buckets of the bucket size plus the remainder (Megatron closes
    a bucket at a parameter boundary and pads it for the distributed optimizer: both
    ignored). With VPP, chunks after the first are one bucket each.
    Stage 3 (Megatron-FSDP, optim_grads_params): gradients are reduce-scattered after every
    micro-batch's backward and parameters all-gathered for every forward and again for
    every backward; one bucket per transformer layer (the FSDP unit) and one for the rest.
    With the loss on this stage (pp == 1), one all_reduce of the mean loss (one fp32).
    """
    n = layout.dp * layout.cp
    if n == 1:
        return []
    c = _Calls(n)
    dense, _, outside = _stage_params(layout, st)
    _grad_sync(c, st, dense, outside, "dense")
    if st.last_stage:
        c.add("all_reduce", 4, 1, "mean loss for logging, once per step")
    return c.as_list()


def _edp_calls(layout: ParallelLayout, st: _Step) -> list[dict]:
    """Data parallelism of the expert parameters (group edp): as `_dp_calls`, for the
    separate buffer of expert weights (experts per layer / (EP x expert-TP))."""
    n = layout.expert_dp
    _, experts, _ = _stage_params(layout, st)
    if n == 1 or not experts:
        return []
    c = _Calls(n)
    _grad_sync(c, st, experts, 0, "expert")
    return c.as_list()


def _pp_calls(layout: ParallelLayout, st: _Step) -> list[dict]:
    """Pipeline parallelism (group pp), the first stage, per micro-batch.

    The p2p tensor is s/cp x b x h x act bytes (s/cp/tp under SP: schedules.py,
    get_tensor_shapes). Without VPP the first stage sends its output forward and receives
    its gradient backward. With VPP=v it holds v chunks: chunk 0 only sends; chunks
    1..v-1 also receive from the last stage (rank pp-1); so forward v sends + v-1
    receives, backward v gradient receives + v-1 sends. Each transfer is one send_recv of
    its bytes. With tied embeddings, once per step the embedding gradient (vocab/tp x h,
    fp32) is all-reduced with the last stage (a group of 2).
    """
    pp = layout.pp
    if pp == 1:
        return []
    c = _Calls(pp)
    v = int(layout.vpp or 1)
    act = st.s_pipe * st.b * st.h * st.act
    c.add("send_recv", act, v * st.micro, "activation send to the next stage, forward")
    c.add("send_recv", act, (v - 1) * st.micro, "activation receive from the last stage (VPP), forward")
    c.add("send_recv", act, v * st.micro, "gradient receive from the next stage, backward")
    c.add("send_recv", act, (v - 1) * st.micro, "gradient send to the last stage (VPP), backward")
    if st.model.tie_embeddings:
        emb = st.params.embedding // layout.tp
        c.add("all_reduce", emb * 4, 1, "tied embedding gradient with the last stage (fp32), once per step",
              group_size=2)
    return c.as_list()


def _ep_group(layout: ParallelLayout, st: _Step) -> tuple[str, int]:
    """(placement kind, size) of the group expert parallelism's traffic runs over: the EP
    group, or for the allgather dispatcher with expert-TP the tp x ep group (etp_ep)."""
    if st.dispatcher == "alltoall" or layout.etp == 1:
        return "ep", layout.ep
    return "etp_ep", layout.ep * layout.etp


def _ep_calls(layout: ParallelLayout, st: _Step) -> list[dict]:
    """Expert parallelism, per MoE layer per micro-batch (every layer is MoE here).

    T = s/cp (/tp under SP) x b tokens enter the layer on this rank; k = top-k; E experts.
    * alltoall dispatcher (group ep): forward, an all_gather of the tokens-per-expert
      counts (E int64 per rank, over the tp x ep group), the dispatch all_to_all of the
      routed tokens (T x k x h x act bytes sent, own slice included) and of their
      probabilities (T x k x act), and the combine all_to_all (T x k x h x act); backward,
      the same three all_to_alls in reverse (combine, tokens, probabilities).
    * allgather dispatcher (group tp x ep): forward all_gathers of the routing map
      (T x E bools), the probabilities (T x E x act) and the tokens (T x h x act), each total
      output n x that, and the combine reduce_scatter (n x T x h x act); backward an
      all_gather (combine) and reduce_scatters of the token and probability gradients.
    * full recompute repeats the forward collectives in the backward.
    Reported under "ep" (as trace_analysis files Megatron's expert groups); the counts'
    all_gather carries its own group size (tp x ep). Expert-TP's own all-gathers inside
    the alltoall dispatcher are not modelled.
    """
    m = st.model
    if not st.moe or layout.ep * layout.etp == 1:
        return []
    n_tpep = layout.ep * layout.etp
    T = st.s_pipe * st.b
    k, E, h, a = int(m.moe_router_topk), int(m.num_experts), st.h, st.act
    per = st.layers * st.micro
    recompute = st.recompute == "full"
    if st.dispatcher == "alltoall":
        if layout.ep == 1:
            return []
        c = _Calls(layout.ep)
        tokens, probs = T * k * h * a, T * k * a
        forward = [("all_gather", E * 8 * n_tpep, "tokens-per-expert counts", n_tpep),
                   ("all_to_all", tokens, "dispatch of the routed tokens", None),
                   ("all_to_all", probs, "dispatch of the routing probabilities", None),
                   ("all_to_all", tokens, "combine of the expert outputs", None)]
        backward = [("all_to_all", tokens, 2, "gradient all-to-all of combine and dispatch"),
                    ("all_to_all", probs, 1, "gradient all-to-all of the routing probabilities")]
    else:
        n = n_tpep
        c = _Calls(n)
        forward = [("all_gather", n * T * E, "all-gather of the routing map", None),
                   ("all_gather", n * T * E * a, "all-gather of the routing probabilities", None),
                   ("all_gather", n * T * h * a, "all-gather of the tokens", None),
                   ("reduce_scatter", n * T * h * a, "combine reduce-scatter of the expert outputs", None)]
        backward = [("all_gather", n * T * h * a, 1, "all-gather of the combine gradient"),
                    ("reduce_scatter", n * T * h * a, 1, "reduce-scatter of the token gradient"),
                    ("reduce_scatter", n * T * E * a, 1, "reduce-scatter of the probability gradient")]
    for coll, size, what, group in forward:
        c.add(coll, size, per, f"{what}, forward", group_size=group)
    for coll, size, times, what in backward:
        c.add(coll, size, times * per, f"{what}, backward")
    if recompute:
        for coll, size, what, group in forward:
            c.add(coll, size, per, f"{what}, recomputed in backward", group_size=group)
    return c.as_list()


def predict_step_communication(cfg, layout: ParallelLayout, profile: CommProfile | None = None,
                               params: ParamCounts | None = None) -> dict:
    """Every collective of ONE training step of ONE rank of the first pipeline stage (the
    one with the embedding, and the worst for DP traffic and p2p), by group kind.

    Returns {kind: {"placement_kind", "group_size", "calls": [{"collective",
    "size_bytes" (nccl-tests convention, one call), "count" (per step), "what",
    "group_size", "seconds" (count x one call; None without a profile)}], "bytes"
    (sum of count x size_bytes), "seconds" (None without a profile)}}, for the kinds
    tp, cp, dp (Megatron's DP group with CP: placement kind dp_cp), pp, ep (placement
    kind ep, or etp_ep for the allgather dispatcher with expert-TP) and edp whose group
    has more than one rank and carries traffic. A call's group_size differs from its
    kind's where Megatron uses a related group (tied embeddings: first and last stage;
    aux loss: tp x cp; token counts: tp x ep). The terms are those of
    `_tp_calls`, `_cp_calls`, `_dp_calls`, `_edp_calls`, `_pp_calls` and `_ep_calls`,
    for the Megatron engine (the plan calls this only for an engine whose rules say it
    models its communication). Micro-batches per step = global batch / (micro batch x DP).

    Not modelled: scalar reductions of the optimizer (gradient norm, found-inf), the
    timers, expert-TP's all-gathers inside the alltoall dispatcher, bucket padding, and
    FP8 (activations are
    counted at the params dtype). With a profile, raises UnmeasuredGroupSize when a
    needed (collective, group size) was not measured.
    """
    t, m = cfg.train, cfg.model
    s, cp, tp = int(t.seq_length), layout.cp, layout.tp
    sixteen = cfg.precision.params_dtype in ("bf16", "fp16")
    st = _Step(
        s=s, s_cp=s // cp, s_pipe=s // cp // (tp if layout.sp else 1), b=int(t.micro_batch_size),
        h=int(m.hidden_size), act=2 if sixteen else 4, param_bytes=2 if sixteen else 4,
        micro=layout.accumulation(t), params=params or param_counts(m),
        layers=int(m.num_layers) // layout.pp, last_stage=layout.pp == 1, moe=int(m.num_experts) > 0,
        model=m, recompute=t.recompute, zero_stage=int(cfg.zero.stage), vpp=int(cfg.parallel.vpp or 1),
        bucket_size=cfg.engine.bucket_size, ddp_bucket=_bucket_elements(cfg.engine, layout),
        dispatcher=cfg.parallel.moe_token_dispatcher,
        cp_comm_type=cp_exchange(cfg.parallel, cfg.model, cfg.data, cfg.cluster.device == "cuda"),
    )
    groups = {  # kind -> (placement kind, group size, calls)
        "tp": ("tp", layout.tp, _tp_calls(layout, st)),
        "cp": ("cp", layout.cp, _cp_calls(layout, st)),
        "dp": ("dp_cp", layout.dp * layout.cp, _dp_calls(layout, st)),
        "pp": ("pp", layout.pp, _pp_calls(layout, st)),
        "ep": (*_ep_group(layout, st), _ep_calls(layout, st)),
        "edp": ("edp", layout.expert_dp, _edp_calls(layout, st)),
    }
    out = {}
    for kind, (placement_kind, size, calls) in groups.items():
        if size <= 1 or not calls:
            continue
        total = 0.0 if profile is not None else None
        for call in calls:
            call["seconds"] = None
            if profile is not None:
                one = profile.seconds(call["collective"], call["group_size"], call["size_bytes"],
                                      kind=placement_kind)
                call["seconds"] = call["count"] * one
                total += call["seconds"]
        out[kind] = {
            "placement_kind": placement_kind,
            "group_size": size,
            "calls": calls,
            "bytes": sum(cl["count"] * cl["size_bytes"] for cl in calls),
            "seconds": total,
        }
    return out
