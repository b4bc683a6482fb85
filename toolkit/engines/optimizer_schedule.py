"""The optimizer's settings, its parameter groups and the learning-rate schedule, for both engines.

Megatron-Core owns each rule; this module only applies them, so the DeepSpeed engine trains
under exactly the Megatron engine's rules instead of a hand-written copy:
- Adam(W) with betas (0.9, 0.95) and Megatron's eps and gradient clipping (`optimizer_config`);
- no weight decay on biases and 1-D parameters (norms), Megatron's standard parameter-group
  overrides, matched against any module's named parameters (`param_groups`);
- linear warm-up from 0, then cosine decay to `min_lr` over `train.steps`, Megatron's
  `OptimizerParamScheduler` over any optimizer's `param_groups` (`lr_scheduler`).
"""
from __future__ import annotations

import torch

from .megatron_model import DTYPES


def optimizer_config(cfg):
    """Megatron-Core's OptimizerConfig for this experiment."""
    from megatron.core.optimizer import OptimizerConfig

    t, p, e = cfg.train, cfg.precision, cfg.engine
    return OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        bf16=p.params_dtype == "bf16",
        fp16=p.params_dtype == "fp16",
        params_dtype=DTYPES[p.params_dtype],
        clip_grad=t.grad_clip,
        use_distributed_optimizer=cfg.zero.stage >= 1,
        overlap_param_gather=e.get("overlap_param_gather", False) or cfg.zero.stage == 3,
        initial_loss_scale=2.0**16 if p.params_dtype == "fp16" else None,
    )


def param_groups(module: torch.nn.Module, config) -> list[dict]:
    """torch parameter groups of `module` under Megatron-Core's standard overrides: decayed
    parameters first, then biases and 1-D parameters with `wd_mult` 0. Each group carries the
    keys `lr_scheduler` reads (`wd_mult`, `lr_mult`, `max_lr`, `min_lr`)."""
    from megatron.core.optimizer import get_standard_config_overrides

    overrides = get_standard_config_overrides(config)
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        matched = [o for key, o in overrides.items() if key.matches(param, name)]
        wd_mult = min((o.get("wd_mult", 1.0) for o in matched), default=1.0)
        (no_decay if wd_mult == 0.0 else decay).append(param)
    common = {"lr_mult": 1.0, "max_lr": config.lr, "min_lr": config.min_lr, "lr": config.lr}
    return [
        {"params": decay, "wd_mult": 1.0, "weight_decay": config.weight_decay, **common},
        {"params": no_decay, "wd_mult": 0.0, "weight_decay": 0.0, **common},
    ]


def lr_scheduler(train, optimizer):
    """Megatron-Core's scheduler over `optimizer.param_groups`; call `.step(increment=1)`
    after every applied update. It sets the first step's rate (0 with a warm-up) at once."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = train
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=t.steps,
        lr_decay_style="cosine",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
        # On resume the config's schedule wins (a run may be extended); the step
        # count comes from the checkpoint.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
