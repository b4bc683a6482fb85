"""The plan: what a validated experiment will be, derived once.

Validation checks it, the printed plan and `plan.json` show it, the worker reads its
FLOPs and memory estimate back from `plan.json`, and sweeps compare their measurements
against it. Every reader sees the same numbers because there is one derivation:
parameter counts, FLOPs, the memory estimate and the predicted communication are each
computed once per plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .comm_model import CommProfile, predict_step_communication
from .layout import ParallelLayout
from .memory_estimate import MemoryEstimate, estimate_memory
from .model_math import ParamCounts, flops_record, param_counts
from .placement import Placement
from .step_time import NoCalibration, load_calibration, predict_step, speeds_for

PLAN_FORMAT = "gridwright-plan/1"


class CommProfileProblem(ValueError):
    """The cluster's collective profile cannot price this layout's communication."""


@dataclass(frozen=True)
class Plan:
    experiment: str
    layout: ParallelLayout
    placement: Placement
    accumulation: int  # micro-batches per step on each data-parallel rank
    tokens_per_step: int
    params: ParamCounts
    flops: dict  # model_math.flops_record: definition, FLOPs/token under each, peak
    memory: MemoryEstimate | None  # GPU clusters only (the check it feeds is against GPU memory)
    zero_settings: dict | None  # what DeepSpeed runs with; None where the engine reads none
    comm_profile: str | None
    predicted_communication: dict | None  # by group kind; None without a profile
    predicted_step: dict | None = None  # step_time's prediction on a calibrated card; else None

    def record(self) -> dict:
        """`plan.json`: the numbers a plan predicts, written into every job directory."""
        m, layout = self.memory, self.layout
        return {
            "format": PLAN_FORMAT,
            "experiment": self.experiment,
            "params": {"total": self.params.total, **asdict(self.params)},
            **self.flops,
            "tokens_per_step": self.tokens_per_step,
            "accumulation": self.accumulation,
            "memory_estimate_gib": m.total_gib if m else None,
            "memory_estimate": asdict(m) | {"total_gib": m.total_gib} if m else None,
            "layout": {**asdict(layout), "dp": layout.dp, "expert_dp": layout.expert_dp, "slug": layout.slug()},
            "groups": {k: v.tolist() for k, v in self.placement.groups.items()},
            "predicted_communication": self.predicted_communication,
            "zero_settings": self.zero_settings,
            **({"comm_profile": self.comm_profile} if self.predicted_communication is not None else {}),
            "predicted_step": self.predicted_step,
        }

    def lines(self) -> list[str]:
        """The plan's FLOPs and communication lines in the printed plan."""
        return plan_lines(self.record())


def derive_plan(cfg, layout: ParallelLayout, placement: Placement, engine) -> Plan:
    """The plan of a config whose layout passed validation. `engine` is the engine's rules
    (`engine_rules.registry.rules(cfg.engine)`), handed in so that planning imports no
    engine. Raises CommProfileProblem when the cluster names a collective profile that
    cannot price this layout."""
    params = param_counts(cfg.model)
    t = cfg.train
    return Plan(
        experiment=cfg.name, layout=layout, placement=placement, accumulation=layout.accumulation(t),
        tokens_per_step=int(t.global_batch_size) * int(t.seq_length), params=params,
        flops=flops_record(cfg, params),
        memory=estimate_memory(cfg, layout, engine, params) if cfg.cluster.device == "cuda" else None,
        zero_settings=engine.zero_settings(cfg.zero, cfg.cluster), comm_profile=cfg.cluster.comm_profile,
        predicted_communication=predict_communication(cfg, layout, engine, params),
        predicted_step=predict_speed(cfg, layout, engine, params))


def predict_speed(cfg, layout: ParallelLayout, engine, params: ParamCounts | None = None) -> dict | None:
    """The step-time model's prediction (`step_time.predict_step`'s record and the card it
    was calibrated on), for a GPU cluster whose card is calibrated and an engine whose
    communication is modelled; else None."""
    if cfg.cluster.device != "cuda" or not engine.CAPABILITIES.models_communication:
        return None
    try:
        speeds = speeds_for(str(cfg.cluster.gpu.name), load_calibration())
    except NoCalibration:
        return None
    return predict_step(cfg, layout, speeds, params).record() | {"card": speeds.card}


def predict_communication(cfg, layout: ParallelLayout, engine, params: ParamCounts | None = None) -> dict | None:
    """Each group's communication per step under the cluster's collective profile; None
    without one, or for an engine whose collectives are not modelled. Raises
    CommProfileProblem when the profile cannot price this layout."""
    profile = cfg.cluster.comm_profile
    if not profile or not engine.CAPABILITIES.models_communication:
        return None
    try:
        return predict_step_communication(cfg, layout, CommProfile.load(profile), params)
    except LookupError as e:
        raise CommProfileProblem(f"cluster.comm_profile: {e}") from e
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise CommProfileProblem(
            f"cluster.comm_profile={profile} is not a gridwright communication profile ({type(e).__name__}: "
            f"{e}). Fix: write one with bench_collectives, or set cluster.comm_profile=null.") from e


def plan_lines(doc: dict) -> list[str]:
    """A plan record's FLOPs and communication lines (also read back from a plan.json)."""
    f = doc["flops_per_token"]
    mfu = (f"mfu uses {doc['flops_definition']}, peak {doc['peak_tflops']:g} TFLOP/s {doc['peak_kind']}"
           if doc["peak_tflops"] > 0 else "no MFU: the cluster's device has no known peak FLOP/s")
    lines = [
        f"FLOPs/token {_flops(f['megatron'])} (megatron: causal attention halved)   "
        f"{_flops(f['palm'])} (palm: attention in full)   {mfu}",
    ]
    pred = doc.get("predicted_communication")
    if pred:
        parts = []
        for group, rec in pred.items():
            secs = rec.get("seconds")
            parts.append(f"{group} {rec['bytes'] / 1e6:,.0f} MB" + (f" {secs * 1e3:,.1f} ms" if secs is not None else ""))
        lines.append("comm/step   " + ("; ".join(parts) if parts else "none (every group has one rank)")
                     + f"   (alpha-beta profile {doc['comm_profile']})")
    step = doc.get("predicted_step")
    if step:
        lines.append(f"predicted   step {step['step_s']:.3f} s, {step['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU "
                     f"{step['mfu'] * 100:.1f} % ({step['card']} calibration; each part in plan.json; "
                     "launcher=advise ranks every layout)")
    return lines


def _flops(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"
