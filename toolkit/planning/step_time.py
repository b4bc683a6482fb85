"""A layout's predicted step time, from parts that are each calibrated and each printed.

One rank of the slowest pipeline stage (the last: it adds the logit layer) runs, per step:

* compute, by kernel class: GEMMs (`model_math.forward_flops_parts`, recomputed forwards
  included) at the card's measured GEMM rate for the precision, attention at its measured
  rate, and the memory-bound rest (norms, SwiGLU, rotary, cross-entropy) at its measured
  seconds per token x hidden x layer; all split by TP (the rest only under SP), CP and PP;
* the optimizer step, streamed through HBM (Adam reads and writes about 30 bytes per
  parameter it owns: the distributed optimizer shards it over DP x CP);
* exposed communication per group: each collective's α-β time (`comm_model`,
  `predict_step_communication`) on the link its group uses (NVLink inside the NVLink
  domain, the cluster's `inter_node_gbps` across it), minus what the layout hides:
  DP's gradient reduce (with `engine.overlap_grad_reduce`) behind the last micro-batch's
  backward, CP's ring exchange behind attention (the share measured), TP's behind the GEMMs (with
  `engine.tp_comm_overlap`); EP and PP traffic, and the rest, is exposed;
* the pipeline bubble: (PP - 1) / VPP micro-batch times (1F1B, interleaved with VPP);
* host time: kernels launched per step x seconds per launch; the step is host-bound when
  that exceeds the GPU's time.

The calibration (`step_time_calibration.json`, one entry per card) is fitted by
`python -m gridwright.evaluations.validate_advisor --fit` from the GPU results files it
names; every other committed GPU row is its test set. Torch-free: the advisor ranks
thousands of layouts in seconds.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .comm_model import AlphaBetaFit, predict_step_communication
from .layout import ORDER_TOKENS, ParallelLayout
from .model_math import ParamCounts, forward_flops_parts, model_flops_per_token, param_counts

CALIBRATION_FILE = Path(__file__).with_name("step_time_calibration.json")
ADAM_BYTES_PER_PARAM = 30  # fp32 grad, master, two moments read; master, moments, bf16 copy written
INTER_NODE_ALPHA_S = 20e-6  # a collective's start across nodes (InfiniBand): not measured here
# Where a layout hides a group's traffic (the rest of every group is exposed)
HIDDEN_BEHIND = {"dp": "the last micro-batch's backward (engine.overlap_grad_reduce)",
                 "edp": "the last micro-batch's backward (engine.overlap_grad_reduce)",
                 "cp": "attention (the ring exchange)",
                 "tp": "the GEMMs (engine.tp_comm_overlap)"}


class NoCalibration(LookupError):
    """The card has no calibrated speeds: the advisor cannot rank layouts on it."""


@dataclass(frozen=True)
class CardSpeeds:
    """One card's measured rates, each fitted from the files in `fitted_from`."""

    card: str  # a name the cluster's gpu.name contains, e.g. "H200"
    matmul_tflops: dict  # rate kind ("bf16", "fp8", "te_fp8": step_time.rate_kind) -> GEMM TFLOP/s achieved
    attention_tflops: float
    other_s_per_unit: dict  # rate kind, "_eager" added uncompiled -> seconds per token x hidden x layer
    memory_tbps: float  # HBM bandwidth (the optimizer step)
    host_s_per_kernel: float
    kernels_per_layer: float  # per micro-batch, forward and backward
    nvlink: dict  # collective -> {"alpha_s", "beta_s_per_byte"}: a group inside the NVLink domain
    cp_ring_hidden: float = 1.0  # the share of CP's ring exchange attention hides (measured)
    fitted_from: list = field(default_factory=list)
    notes: list = field(default_factory=list)


CALIBRATION_ENV = "GRIDWRIGHT_STEP_TIME_CALIBRATION"  # another calibration file (a card measured here)


def load_calibration(path: Path | None = None) -> list[CardSpeeds]:
    path = path or os.environ.get(CALIBRATION_ENV) or CALIBRATION_FILE
    return [CardSpeeds(**entry) for entry in json.loads(Path(path).read_text())["cards"]]


def speeds_for(gpu_name: str, calibration: list[CardSpeeds]) -> CardSpeeds:
    for speeds in calibration:
        if speeds.card.lower() in gpu_name.lower():
            return speeds
    raise NoCalibration(f"no calibrated speeds for the card '{gpu_name}' (calibrated: "
                        f"{', '.join(s.card for s in calibration)}); measure it with bench_gpu and "
                        "`python -m gridwright.evaluations.validate_advisor --fit`")


class LinkModel:
    """α-β time of one collective on the link its group uses, with the interface of
    `comm_model.CommProfile` (`predict_step_communication` asks it). Inside the NVLink
    domain a ring's bus bandwidth does not depend on the group's size, so the fit of a
    two-GPU group serves every size (bus factors from `comm_model.bus_factor`); a group
    whose ranks span nodes runs at the cluster's per-GPU inter-node bandwidth."""

    def __init__(self, speeds: CardSpeeds, layout: ParallelLayout, inter_node_gbps: float):
        self.speeds, self.layout, self.inter_node_gbps = speeds, layout, inter_node_gbps

    def crosses_nodes(self, kind: str) -> bool:
        """Whether a group of placement kind `kind` spans more than one NVLink domain:
        its ranks are `stride` apart, the stride being the degrees before it in the order."""
        lay = self.layout
        degrees = {"tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp, "pp": lay.pp}
        tokens = {"dp_cp": ("cp", "dp"), "etp_ep": ("tp", "ep"), "edp": ("ep", "dp")}.get(kind, (kind,))
        order = [t for t in lay.order.split("-") if t in ORDER_TOKENS]
        first = min(order.index(t) for t in tokens if t in order)
        stride = 1
        for token in order[:first]:
            stride *= degrees[token]
        span = stride
        for token in tokens:
            span *= degrees.get(token, 1)
        return span > lay.nvlink_domain_size

    def seconds(self, collective: str, group_size: int, size_bytes: float, kind: str | None = None) -> float:
        if group_size <= 1:
            return 0.0
        if kind is not None and self.crosses_nodes(kind):
            fit = AlphaBetaFit(collective, group_size, INTER_NODE_ALPHA_S, 1.0 / (self.inter_node_gbps * 1e9), 0.0, 0)
        else:
            link = self.speeds.nvlink[collective]
            fit = AlphaBetaFit(collective, group_size, link["alpha_s"], link["beta_s_per_byte"], 0.0, 0)
        return fit.seconds(size_bytes)


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    parts: dict  # part name -> seconds on the GPU's path (they add up to step_s unless host-bound)
    communication: dict  # group kind -> {"seconds" (all of it), "exposed_s", "hidden_behind"}
    tokens_per_s_per_gpu: float
    mfu: float
    host_s: float  # launching the step's kernels; the step is host-bound when it exceeds the parts
    host_bound: bool

    def record(self) -> dict:
        return {"step_s": self.step_s, "parts": self.parts, "communication": self.communication,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, "host_s": self.host_s,
                "host_bound": self.host_bound}


def _peak_kind(cfg) -> str:
    return "fp8" if cfg.precision.fp8_recipe is not None else "bf16"


def rate_kind(cfg) -> str:
    """Which measured rates a run's kernels go at: its precision's, Transformer Engine's own
    where the config asks for its layers ("te_fp8"); `auto` is priced as torch-native."""
    te = str(cfg.engine.layer_spec) == "transformer_engine"
    return ("te_" if te else "") + _peak_kind(cfg)


def _rate(rates: dict, kind: str):
    """A kind's rate, else the torch-native one of its precision, else bf16's."""
    return rates.get(kind, rates.get(kind.removeprefix("te_"), rates["bf16"]))


def other_rate(speeds: CardSpeeds, kind: str, compiled: bool) -> float:
    """Seconds per token x hidden x layer of the memory-bound kernels; an uncalibrated
    combination scales the calibrated one by bf16's eager-to-compiled ratio."""
    rates = speeds.other_s_per_unit
    if kind.startswith("te_"):  # TE's fused kernels: compiling its layers is not asked
        return _rate(rates, kind)
    key = kind if compiled else f"{kind}_eager"
    if key in rates:
        return rates[key]
    eager_over_compiled = rates["bf16_eager"] / rates["bf16"]
    return rates[kind] * eager_over_compiled if not compiled else rates["bf16"]


def predict_step(cfg, layout: ParallelLayout, speeds: CardSpeeds, params: ParamCounts | None = None) -> StepPrediction:
    """The predicted step of `cfg` at `layout` on the card `speeds` describes (Megatron engine)."""
    m, t = cfg.model, cfg.train
    pc = params or param_counts(m)
    seq, tp, pp, cp = int(t.seq_length), layout.tp, layout.pp, layout.cp
    vpp = int(layout.vpp or 1)
    micro = max(1, layout.accumulation(t))
    tokens = micro * int(t.micro_batch_size) * seq / cp  # this rank's tokens per step
    layers = int(m.num_layers) / pp
    parts_ = forward_flops_parts(m, seq, pc)
    passes = {"none": 3.0, "selective": 3.0, "full": 4.0}[str(t.recompute)]  # forward, two backward GEMMs, recompute
    attention_passes = 3.0 + (1.0 if str(t.recompute) in ("selective", "full") else 0.0)
    matmul_flops = tokens * (layers * parts_["layer_matmul"] * passes + parts_["output"] * 3.0) / tp
    attention_flops = tokens * layers * parts_["layer_attention"] * attention_passes / tp
    kind = rate_kind(cfg)
    matmul_s = matmul_flops / (_rate(speeds.matmul_tflops, kind) * 1e12)
    attention_s = attention_flops / (speeds.attention_tflops * 1e12)
    other_units = tokens * int(m.hidden_size) * layers / (tp if layout.sp else 1)
    other_s = other_units * other_rate(speeds, kind, bool(cfg.engine.compile_layers)) * (passes / 3.0)
    owned = (layers * (pc.per_layer_dense / tp) + pc.output / tp) / (layout.dp * cp if cfg.zero.stage >= 1 else 1)
    owned += layers * pc.expert_per_layer / (layout.ep * layout.etp) / (layout.expert_dp if cfg.zero.stage >= 1 else 1)
    optimizer_s = owned * ADAM_BYTES_PER_PARAM / (speeds.memory_tbps * 1e12)
    compute_s = matmul_s + attention_s + other_s

    links = LinkModel(speeds, layout, float(cfg.cluster.inter_node_gbps or 0) or 25.0)
    groups = predict_step_communication(cfg, layout, links, pc)
    communication, exposed = {}, {}
    backward_last = compute_s / micro * 2.0 / 3.0
    for group, info in groups.items():
        seconds = float(info["seconds"] or 0.0)
        if group in ("dp", "edp") and cfg.engine.overlap_grad_reduce:
            shown = max(0.0, seconds - backward_last)
        elif group == "cp" and str(cfg.parallel.cp_comm_type) != "a2a":
            shown = seconds - min(seconds * speeds.cp_ring_hidden, attention_s)
        elif group == "tp" and cfg.engine.tp_comm_overlap:
            shown = max(0.0, seconds - matmul_s)
        else:
            shown = seconds
        communication[group] = {"seconds": seconds, "exposed_s": shown,
                                "hidden_behind": HIDDEN_BEHIND.get(group) if shown < seconds else None}
        exposed[group] = shown
    per_micro = (compute_s + exposed.get("tp", 0.0) + exposed.get("ep", 0.0)) / micro
    bubble_s = (pp - 1) / vpp * per_micro
    gpu_s = compute_s + optimizer_s + bubble_s + sum(exposed.values())
    host_s = micro * layers * speeds.kernels_per_layer * speeds.host_s_per_kernel
    step_s = max(gpu_s, host_s)
    parts = {"matmul": matmul_s, "attention": attention_s, "other": other_s, "optimizer": optimizer_s,
             "bubble": bubble_s, **{f"exposed {g}": s for g, s in exposed.items()}}
    per_gpu = int(t.global_batch_size) * seq / layout.world_size / step_s
    peak = float(cfg.cluster.gpu.peak_fp8_tflops if _peak_kind(cfg) == "fp8" else cfg.cluster.gpu.peak_bf16_tflops)
    flops = model_flops_per_token(m, seq, str(cfg.evaluate.flops_definition), pc)
    mfu = per_gpu * flops / (peak * 1e12) if peak else 0.0
    return StepPrediction(step_s, parts, communication, per_gpu, mfu, host_s, host_s > gpu_s)

