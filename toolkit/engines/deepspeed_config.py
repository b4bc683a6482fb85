"""DeepSpeed's JSON config for an experiment: batch, precision, clipping and the ZeRO
settings (`conf/zero`), built once here for both DeepSpeed trainers."""
from __future__ import annotations

from ..planning.layout import ParallelLayout
from .optimizer_schedule import optimizer_config
from ..engine_rules.zero_settings import GRIDWRIGHT_KEYS, ZEROPP_OFF, resolved_zero_settings


def deepspeed_config(cfg, layout: ParallelLayout, load_universal: bool = False) -> dict:
    """DeepSpeed's JSON config for this experiment; `load_universal` when it resumes a
    checkpoint saved at another data-parallel size (deepspeed_checkpoint)."""
    t, z, p = cfg.train, cfg.zero, cfg.precision
    # The ZeRO settings the stage reads (conf/zero; null keys resolved to DeepSpeed's defaults, see
    # zero_settings); ZeRO++ keys only when on, so that a config without them reads as before.
    zero = {"stage": z.stage, **{k: v for k, v in resolved_zero_settings(z, cfg.cluster).items()
                                 if k not in GRIDWRIGHT_KEYS and (k not in ZEROPP_OFF or v != ZEROPP_OFF[k])}}
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.cluster.device == "cuda"}
    if z.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cfg.cluster.device == "cuda"}
    out = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * layout.dp),
        "train_batch_size": t.global_batch_size,
        "zero_optimization": zero,
        "bf16": {"enabled": p.params_dtype == "bf16"},
        "fp16": {"enabled": p.params_dtype == "fp16", "initial_scale_power": 16},
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if load_universal:
        out["checkpoint"] = {"load_universal": True}
    if z.offload_optimizer:
        # ZeRO-Offload refuses a client (torch) optimizer; DeepSpeed's own CPU Adam is used,
        # with the Megatron engine's settings (the parameter groups carry weight decay).
        opt = optimizer_config(cfg)
        out["optimizer"] = {"type": "AdamW", "params": {"lr": t.lr, "betas": [opt.adam_beta1, opt.adam_beta2],
                                                         "eps": opt.adam_eps, "weight_decay": t.weight_decay}}
    return out
