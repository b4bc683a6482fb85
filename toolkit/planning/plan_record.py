"""`plan.json`: the numbers a plan predicts, written into every job directory.

Parameter counts, FLOPs per token under every definition (and the one behind `mfu`), the
peak MFU is measured against, the per-GPU memory estimate, the layout and its groups, the
ZeRO settings DeepSpeed runs with (engine=deepspeed), and, when the cluster names a
collective-cost profile, each group's predicted communication per step. Runs and sweeps
compare their measurements against this record.
"""
from __future__ import annotations

from dataclasses import asdict

from ..engines.registry import rules
from .memory_estimate import estimate_memory
from .model_math import flops_record, param_counts

PLAN_FORMAT = "gridwright-plan/1"


def plan_record(cfg, layout, placement) -> dict:
    t = cfg.train
    pc = param_counts(cfg.model)
    memory = estimate_memory(cfg, layout) if cfg.cluster.device == "cuda" else None
    doc = {
        "format": PLAN_FORMAT,
        "experiment": cfg.name,
        "params": {"total": pc.total, **asdict(pc)},
        **flops_record(cfg),
        "tokens_per_step": t.global_batch_size * t.seq_length,
        "accumulation": t.global_batch_size // (t.micro_batch_size * layout.dp),
        # Estimated only for GPU clusters (the check it feeds is against GPU memory).
        "memory_estimate_gib": memory.total_gib if memory else None,
        "memory_estimate": asdict(memory) | {"total_gib": memory.total_gib} if memory else None,
        "layout": {**asdict(layout), "dp": layout.dp, "expert_dp": layout.expert_dp, "slug": layout.slug()},
        "groups": {k: v.tolist() for k, v in placement.groups.items()},
        "predicted_communication": None,
        # The ZeRO settings DeepSpeed runs with (conf/zero, null keys resolved to DeepSpeed's
        # defaults); None on engine=megatron, which reads none of them.
        "zero_settings": rules(cfg).zero_settings(cfg),
    }
    if cfg.cluster.comm_profile and rules(cfg).CAPABILITIES.models_communication:
        from .comm_model import CommProfile, predict_step_communication

        doc["comm_profile"] = cfg.cluster.comm_profile
        doc["predicted_communication"] = predict_step_communication(
            cfg, layout, CommProfile.load(cfg.cluster.comm_profile))
    return doc


def plan_lines(doc: dict) -> list[str]:
    """The plan record's lines in the printed plan."""
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
    return lines


def _flops(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"
