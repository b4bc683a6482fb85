"""Checkpoints of the Megatron-Core engine: distributed (torch_dist), resumable, reshardable.

On disk, under `checkpoint.save`, as `checkpoint_dir` describes: `iter_N/` directories
and a `latest` pointer, published as `checkpoint_publish` does for both engines (a
process killed mid-save leaves the previous checkpoint as the one that loads). Model and optimizer are sharded state dicts (the
distributed optimizer in its fully reshardable form), so a checkpoint loads onto another
TP/PP/EP layout. Step, scheduler, layout and seed are common state; RNG states are saved
per rank and restored only onto the same layout (they have no meaning on another).
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoints.checkpoint_dir import (
    CheckpointError,
    checkpoint_to_load,
    engine_of,
    iteration_name,
    model_differences,
)
from ..checkpoints.checkpoint_trust import load_state_dict_vetted, read_dcp_metadata, refuse_pickled_code_on_every_rank
from ..megatron_internals.checkpoint_format import materialise_distributed_optimizer_states, results_queue_across_fork
from ..planning.disk_space import checkpoint_bytes
from .checkpoint_publish import open_iteration, saying_when_full, staged_iteration
from .optimizer_schedule import restore_schedule, set_adam_form


def _layout_signature(layout) -> dict:
    return {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "ep": layout.ep,
            "etp": layout.etp, "dp": layout.dp, "world_size": layout.world_size}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as torch and Python values: a checkpoint holds no numpy objects, whose
        # unpickling (dtype.__setstate__) a crafted file could abuse (gridwright.checkpoints.checkpoint_trust).
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "tracker": _tracker_states(tensor_parallel.get_cuda_rng_tracker()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    _restore_tracker(tensor_parallel.get_cuda_rng_tracker(), state["tracker"])


def _tracker_states(tracker) -> dict:
    """The tracker's states as tensors: under CUDA graphs (graph-safe generators) they are
    torch.Generator objects, which a checkpoint cannot hold without pickled code."""
    return {name: s.get_state() if isinstance(s, torch.Generator) else s for name, s in tracker.get_states().items()}


def _restore_tracker(tracker, saved: dict) -> None:
    """Saved tensor states into the tracker, into its graph-safe generators where it has
    them (the generators CUDA graphs registered must stay the same objects)."""
    current = tracker.get_states()
    if any(isinstance(s, torch.Generator) for s in current.values()):
        for name, state in saved.items():
            current[name].set_state(state)
        tracker.set_states(current)
    else:
        tracker.set_states(dict(saved))


def _sharded_state(trainer, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = {}
    for i, m in enumerate(trainer.model):
        model_sd[f"model{i}"] = m.module.sharded_state_dict()
    state = dict(model_sd)
    if is_loading:
        materialise_distributed_optimizer_states(trainer.optimizer)
    # Without the "chained_N." prefix the optimizer state is keyed by parameter alone, so it
    # loads whether or not the target layout splits experts into a second optimizer (EP>1).
    meta = {"chained_optim_avoid_prefix": True}
    if trainer.cfg.zero.stage >= 1:
        meta["distrib_optim_sharding_type"] = "fully_reshardable"
    # The optimizer finds its parameters' shards anywhere in this nested dict.
    state["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


def _match_optimizer_structure(loaded: dict, target: dict, path: Path) -> dict:
    """Fit a one-optimizer checkpoint to a chained optimizer (dense + experts, as EP>1 or an
    expert-TP different from TP builds).

    Tensor states are keyed by parameter and load into either structure; only the
    common part (param groups, step count) follows the saving run's structure.
    """
    def chained(d: dict) -> bool:  # a chained optimizer's state is keyed 0, 1, ...
        return bool(d) and all(isinstance(k, int) for k in d)

    chained_target = chained(target)
    if chained_target == chained(loaded):
        return loaded
    if not chained_target or "param_groups" not in loaded:
        raise CheckpointError(
            f"{path} was saved with a different split into dense and expert optimizers (EP>1 or an "
            "expert-TP different from TP builds two). "
            "Fix: resume with the saving run's expert layout and ZeRO stage, or set checkpoint.weights_only=true."
        )
    common_step = loaded.get("state", {}).get("common_step")
    out = {}
    for idx in target:
        sub = dict(loaded[idx])
        sub["param_groups"] = [
            {k: (v.unwrap() if hasattr(v, "unwrap") else v) for k, v in group.items()}
            for group in target[idx]["param_groups"]
        ]
        if common_step is not None:
            sub["state"] = dict(sub["state"], common_step=common_step)
        out[idx] = sub
    return out


def _model_config_dict(model_cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(model_cfg, resolve=True)


def model_weights_state(chunks: list, checkpoint_dir: str | os.PathLike) -> dict:
    """The sharded state of bare GPTModel chunks, fitted to what `checkpoint_dir` holds.

    Linear layers carry `_extra_state` objects (TE's FP8 metadata; None in the local spec).
    They are no weights: a checkpoint written by another spec or by the converter may lack
    them, so weights-only loads drop those the checkpoint does not have.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    stored = read_dcp_metadata(checkpoint_dir).state_dict_metadata

    def keep(v) -> bool:
        return not (isinstance(v, ShardedObject) and v.key.endswith("_extra_state") and v.unique_key not in stored)

    state = {}
    for i, chunk in enumerate(chunks):
        state[f"model{i}"] = {k: v for k, v in chunk.sharded_state_dict().items() if keep(v)}
    return state


def load_model_weights(chunks: list, checkpoint_dir: str | os.PathLike) -> None:
    """Load model weights only into bare GPTModel chunks (converted checkpoints, evaluation)."""
    from megatron.core import dist_checkpointing

    refuse_pickled_code_on_every_rank(checkpoint_dir)
    state = model_weights_state(chunks, checkpoint_dir)
    loaded = dist_checkpointing.load(state, str(checkpoint_dir))
    for i, chunk in enumerate(chunks):
        _load_weights_into(chunk, loaded[f"model{i}"], checkpoint_dir)


def _load_weights_into(module, state: dict, path) -> None:
    """load_state_dict that tolerates absent `_extra_state` entries and nothing else (TE's
    FP8 extra states read without running code first: checkpoint_trust)."""
    result = load_state_dict_vetted(module, state, str(path))
    wrong = [k for k in result.missing_keys + result.unexpected_keys if not k.endswith("_extra_state")]
    if wrong:
        raise CheckpointError(f"{path}: weights do not match the model: {', '.join(wrong[:8])}")


def save(trainer, step: int, root: str | os.PathLike, background=None) -> Path:
    """Save after `step` completed steps; returns the checkpoint directory. With `background`
    (a BackgroundSaves), Megatron-Core's async save stages the state and a forked process
    writes it: the directory exists once `background` has published it."""
    from megatron.core import dist_checkpointing

    ck = trainer.cfg.checkpoint
    size = checkpoint_bytes(trainer.cfg.model, trainer.cfg.precision)
    results_queue_across_fork()
    if background is not None:
        partial = open_iteration(root, step)
        with saying_when_full(root, size):  # the common state is written now
            request = dist_checkpointing.save(_full_state(trainer, step), str(partial), async_sharded_save=True)
        background.submit(request, step, root, size)
        return Path(root) / iteration_name(step)
    with staged_iteration(root, step, ck.keep_last, size) as partial:
        dist_checkpointing.save(_full_state(trainer, step), str(partial))
    return Path(root) / iteration_name(step)


def _full_state(trainer, step: int) -> dict:
    """Model, optimizer and RNG (sharded), and the common state of step, schedule and layout."""
    state = _sharded_state(trainer, is_loading=False, with_rng=True)
    state["common"] = {
        "step": step,
        "scheduler": trainer.scheduler.state_dict(),
        "layout": _layout_signature(trainer.layout),
        "seed": trainer.cfg.train.seed,
        "model": trainer.cfg.model.name,
        "model_config": _model_config_dict(trainer.cfg.model),
        "distributed_optimizer": trainer.cfg.zero.stage >= 1,
    }
    return state


def load(trainer, root: str | os.PathLike, weights_only: bool = False,
         fallback: bool = False) -> tuple[int, Path, str | None]:
    """Restore from the newest checkpoint under `root` (with `fallback`, the newest intact
    one); returns the step to continue from, the checkpoint loaded, and the line saying how
    this run's config changed the learning-rate schedule (None: unchanged)."""
    from megatron.core import dist_checkpointing

    path = checkpoint_to_load(root, fallback)
    if path is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    if engine_of(path) != "megatron":
        raise CheckpointError(f"{path} was written by the DeepSpeed engine; convert it (python -m "
                              "gridwright.adapters.convert deepspeed-to-megatron) to load it here.")
    refuse_pickled_code_on_every_rank(path)  # before an upstream reader touches a file
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    recorded = common.get("model_config")
    if recorded:  # shape, not name, decides (a converted model may be renamed)
        diffs = model_differences(recorded, trainer.cfg.model)
        if diffs:
            raise CheckpointError(f"{path} was written for another model shape: {', '.join(diffs)}")
    elif common["model"] != trainer.cfg.model.name:
        raise CheckpointError(
            f"{path} holds model '{common['model']}', but this run builds '{trainer.cfg.model.name}'."
        )
    # A converted checkpoint holds weights only: training starts from it at step 0.
    weights_only = weights_only or common.get("weights_only", False)
    same_layout = common["layout"] == _layout_signature(trainer.layout)
    distributed = trainer.cfg.zero.stage >= 1
    if not weights_only and common.get("distributed_optimizer", distributed) != distributed:
        raise CheckpointError(
            f"{path} was saved {'with' if not distributed else 'without'} the distributed optimizer "
            f"(ZeRO stage {'1-2' if not distributed else '0'}); this run uses zero.stage={trainer.cfg.zero.stage}, "
            "whose optimizer state has another form. Fix: resume with the saving run's ZeRO stage, "
            "or set checkpoint.weights_only=true to start a fresh optimizer."
        )
    if weights_only:
        state = model_weights_state([m.module for m in trainer.model], path)
    else:
        state = _sharded_state(trainer, is_loading=True, with_rng=same_layout)
    target_optimizer = None if weights_only else state["optimizer"]
    loaded = dist_checkpointing.load(state, str(path))
    for i, m in enumerate(trainer.model):
        _load_weights_into(m.module, loaded[f"model{i}"], path)
    if weights_only:
        # In bf16/fp16 the optimizer keeps fp32 main copies of the weights, drawn when it was
        # built; its first step writes them back over the model. Without this refresh a run
        # "from" a converted checkpoint trained from its own random draw after step 0 (seen on
        # 2 x H200: the Megatron engine parted from DeepSpeed started on the same weights).
        trainer.optimizer.reload_model_params()
        return 0, path, None
    trainer.optimizer.load_state_dict(_match_optimizer_structure(loaded["optimizer"], target_optimizer, path))
    set_adam_form(trainer.optimizer, trainer.cfg.engine.fused_adam)  # the loaded groups carry the saver's form
    schedule_change = restore_schedule(trainer.scheduler, common["scheduler"], int(common["step"]))
    if same_layout:
        _set_rng_state(loaded["rng"])
    return int(common["step"]), path, schedule_change
