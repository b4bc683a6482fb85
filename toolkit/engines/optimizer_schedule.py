"""The optimizer's settings, its parameter groups and the learning-rate schedule, for both engines.

Megatron-Core owns each rule; this module only applies them, so the DeepSpeed engine trains
under exactly the Megatron engine's rules instead of a hand-written copy:
- Adam(W) with betas (0.9, 0.95) and Megatron's eps and gradient clipping (`optimizer_config`);
- no weight decay on biases and 1-D parameters (norms), Megatron's standard parameter-group
  overrides, matched against any module's named parameters (`param_groups`);
- linear warm-up from 0, then cosine decay to `min_lr` over `train.steps`, Megatron's
  `OptimizerParamScheduler` over any optimizer's `param_groups` (`lr_scheduler`);
- torch's AdamW in its fused form for both (`adamw`, `set_adam_form`).
"""
from __future__ import annotations

import copy

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


def adamw(groups: list[dict], config, fused: bool) -> torch.optim.AdamW:
    """torch's AdamW under `config` (optimizer_config), for the DeepSpeed engine's client
    optimizer: the Megatron engine's update, in the form engine.fused_adam names (`set_adam_form`)."""
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, weight_decay=config.weight_decay, fused=fused or None)


def set_adam_form(optimizer, fused: bool) -> bool:
    """Put the torch Adam(W) inside an engine's optimizer (Megatron-Core's, DeepSpeed's ZeRO
    wrappers) in torch's fused form, or in its foreach form with `fused` False
    (engine.fused_adam).

    Without Apex or Transformer Engine Megatron-Core builds torch's AdamW with its defaults,
    which on CUDA is the foreach form: about ten passes over every fp32 state per step, and a
    sqrt(v) temporary as large as a parameter group. The fused form makes one pass (the
    foreach form took 96 ms of a 1.6 s step on the Llama-3-8B shape, 16 layers, one H200).
    Megatron-Core has no setting for it, so the flags are set on the parameter groups, which
    torch reads at every step. Call it after loading a state dict too: torch's
    `load_state_dict` takes the saved groups, flags included. Returns whether a torch Adam
    was found (none under Apex's or TE's FusedAdam, or DeepSpeed's CPU Adam)."""
    found = False
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt if isinstance(opt, torch.optim.Adam) else getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW is an Adam in torch >= 2.7
            continue
        found = True
        for group in inner.param_groups:
            group.update(fused=True if fused else None, foreach=False if fused else None)
        # By the states' own keys, not the groups': DeepSpeed's ZeRO-3 keeps its groups empty
        # outside its step (stage3.py), and its loads leave the step counts on the host.
        for param, state in inner.state.items():
            step = state.get("step")
            if torch.is_tensor(step):  # fused: beside the parameter; foreach: on the host, as torch keeps it
                state["step"] = step.to(device=param.device if fused else "cpu", dtype=torch.float32)
    return found


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


# The scheduler's saved settings and the config keys that set them (lr_scheduler above).
_SCHEDULE_KEYS = (("lr_decay_steps", "train.steps"), ("max_lr", "train.lr"), ("min_lr", "train.min_lr"),
                  ("lr_warmup_steps", "train.warmup_steps"), ("lr_decay_style", "the decay style"))


def restore_schedule(scheduler, saved: dict, step: int) -> str | None:
    """Load the saved scheduler state into `scheduler` (built from this run's config, which
    wins: lr_scheduler's override) and say, in one line, when the config changed the
    schedule since the save, with the learning rate of step `step` before and after: a run
    extended from 10 to 20 steps otherwise re-derives its cosine silently (with the default
    rates, 1.0e-3 at step 10 becomes 6.3e-3). None when the schedule is the saved one."""
    scheduler.load_state_dict(saved)
    changed = [(key, name) for key, name in _SCHEDULE_KEYS if key in saved and saved[key] != getattr(scheduler, key)]
    if not changed:
        return None
    before = copy.copy(scheduler)  # the saved schedule, at the same step count
    for key, _ in changed:
        setattr(before, key, saved[key])
    was = before.get_lr({"max_lr": before.max_lr, "min_lr": before.min_lr})
    now = scheduler.get_lr({"max_lr": scheduler.max_lr, "min_lr": scheduler.min_lr})
    what = ", ".join(f"{name} {_value(saved[key])} -> {_value(getattr(scheduler, key))}" for key, name in changed)
    return (f"{what} change{'s' if len(changed) == 1 else ''} the LR schedule: "
            f"lr at step {step} was {was:.1e}, is now {now:.1e}")


def _value(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
