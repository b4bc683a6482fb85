"""Checkpoints of the DeepSpeed engine, with the Megatron engine's guarantees.

On disk, under `checkpoint.save`, as `checkpoint_dir` describes: `iter_N/` directories
and a `latest` pointer, so one root never mixes engines' conventions. DeepSpeed writes
its own files (`save_checkpoint`, tag `iter_N.partial`, without its own `latest`); once
every rank has written, rank 0 adds the manifest (common state and each file's size),
and the directory is published as `checkpoint_publish` does for both engines (a process
killed mid-save leaves the previous checkpoint as the one that loads).

The learning-rate schedule is Megatron-Core's `OptimizerParamScheduler`, owned by the
engine rather than by DeepSpeed, so its state travels in the manifest. The data stream
is a function of the step, so the step restores it. The optimizer state is partitioned
by data-parallel rank and shaped by the ZeRO stage, precision and offload: a resume must
share them (`checkpoint_dir.deepspeed_settings`; validation refuses otherwise).

The manifest also keeps a digest of the saved model's logits, from the engine's own
forward (`logits_digest`): conversion to Hugging Face consolidates the partitions and
checks the result against it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..atomic_io import write_text_atomic
from ..checkpoint_dir import (
    DEEPSPEED_MANIFEST,
    CheckpointError,
    checkpoint_to_load,
    deepspeed_settings,
    engine_of,
    iteration_name,
    model_differences,
    read_common,
)
from ..logits_digest import digest, sample_tokens
from .checkpoint_publish import staged_iteration


def logits_digest(trainer) -> dict:
    """The digest of the model's logits as the engine computes them now (collective:
    ZeRO-3 gathers each layer's weights from every rank for the forward)."""
    module = trainer.engine.module
    tokens = sample_tokens(trainer.cfg.model.vocab_size).to(trainer.device)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        logits = module(input_ids=tokens).logits
    module.train(was_training)
    return digest(logits)


def save(trainer, step: int, root: str | os.PathLike) -> Path:
    """Save after `step` completed steps; returns the final checkpoint directory."""
    import deepspeed

    with staged_iteration(root, step) as partial:
        fingerprint = logits_digest(trainer)
        trainer.engine.save_checkpoint(str(partial.parent), tag=partial.name, save_latest=False)
        dist.barrier()
        if dist.get_rank() == 0:
            cfg = trainer.cfg
            manifest = {
                "format": "deepspeed",
                "deepspeed_version": deepspeed.__version__,
                "common": {
                    "engine": "deepspeed",
                    "step": step,
                    "scheduler": trainer.scheduler.state_dict(),
                    "settings": deepspeed_settings(cfg, trainer.layout.dp),
                    "seed": cfg.train.seed,
                    "model": cfg.model.name,
                    "model_config": OmegaConf.to_container(cfg.model, resolve=True),
                },
                "logits_digest": fingerprint,
                "files": {str(f.relative_to(partial)): f.stat().st_size
                          for f in sorted(partial.rglob("*")) if f.is_file()},
            }
            write_text_atomic(partial / DEEPSPEED_MANIFEST, json.dumps(manifest, indent=1))
    return Path(root) / iteration_name(step)


def load(trainer, root: str | os.PathLike, fallback: bool = False) -> tuple[int, Path]:
    """Restore model, optimizer, schedule and step from the newest checkpoint under `root`
    (with `fallback`, the newest intact one); returns the step to continue from and the
    checkpoint loaded. Validation has refused what this would refuse; a job launched
    elsewhere (Slurm, torchrun lines) meets the same checks here."""
    path = checkpoint_to_load(root, fallback)
    if path is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    if engine_of(path) != "deepspeed":
        raise CheckpointError(f"{path} was written by the Megatron engine; engine=deepspeed resumes only its own "
                              "checkpoints (convert it to a Hugging Face folder to start from its weights).")
    common = read_common(path)
    cfg = trainer.cfg
    diffs = model_differences(common["model_config"], cfg.model)
    if diffs:
        raise CheckpointError(f"{path} was written for another model shape: {', '.join(diffs)}")
    wanted = deepspeed_settings(cfg, trainer.layout.dp)
    if common["settings"] != wanted:
        raise CheckpointError(f"{path} was saved with DeepSpeed settings {common['settings']}; this run has {wanted}")
    loaded, _ = trainer.engine.load_checkpoint(str(path.parent), tag=path.name, load_lr_scheduler_states=False)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {path}")
    trainer.scheduler.load_state_dict(common["scheduler"])
    return int(common["step"]), path
