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
share the stage, precision and offload (`deepspeed_rules.settings`; validation
refuses otherwise). The data-parallel size may change under ZeRO 1-3 without offload:
rank 0 converts the checkpoint to DeepSpeed's universal form once (`ds_to_universal`, into
the job directory; the saved checkpoint is not touched) and every rank loads that. What
this leans on inside DeepSpeed (the converter, the repair of its ZeRO-3 load) is in
`deepspeed_internals.universal`.

The manifest also keeps a digest of the saved model's logits, from the engine's own
forward (`logits_digest`): conversion to Hugging Face consolidates the partitions and
checks the result against it.
"""
from __future__ import annotations

import collections
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..basics.atomic_io import scratch_directory, write_text_atomic
from ..checkpoints.checkpoint_dir import (
    DEEPSPEED_MANIFEST,
    CheckpointError,
    checkpoint_to_load,
    engine_of,
    holds_checkpoints,
    iteration_name,
    model_differences,
    read_common,
)
from ..checkpoints.checkpoint_trust import guarded_module_command, load_torch_file, refuse_pickled_code_on_every_rank
from ..deepspeed_internals import universal
from ..checkpoints.logits_digest import digest, sample_tokens
from ..planning.disk_space import checkpoint_bytes
from .checkpoint_publish import open_iteration, saying_when_full, staged_iteration
from .optimizer_schedule import restore_schedule, set_adam_form
from ..engine_rules.deepspeed_rules import resharding, settings


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


def save(trainer, step: int, root: str | os.PathLike, background=None) -> Path:
    """Save after `step` completed steps; returns the checkpoint directory. With `background`
    (a BackgroundSaves), DeepSpeed's files are staged (`StagedFiles`) and a forked process
    writes them: the directory exists once `background` has published it."""
    ck = trainer.cfg.checkpoint
    size = checkpoint_bytes(trainer.cfg.model, trainer.cfg.precision)
    if background is None:
        with staged_iteration(root, step, ck.keep_last, size) as partial:
            fingerprint = logits_digest(trainer)
            _save_files(trainer, partial)
            dist.barrier()
            if dist.get_rank() == 0:
                _write_manifest(_manifest(trainer, step, fingerprint), partial)
        return Path(root) / iteration_name(step)
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    partial = open_iteration(root, step)
    manifest = _manifest(trainer, step, logits_digest(trainer))  # the state now, not at the write's end
    staged = StagedFiles(trainer.engine.checkpoint_engine)
    with saying_when_full(root, size):  # DeepSpeed copies a script into the directory now
        _save_files(trainer, partial, staged)
    outcome = multiprocessing.Pipe(duplex=False)

    def complete() -> None:  # every rank, once every rank's writer has ended
        failed = _write_failed(outcome[0])
        flags = torch.tensor([int(failed is not None)], dtype=torch.int, device=trainer.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if failed is not None:
            raise failed
        if flags.item():
            raise CheckpointError(f"another rank's write of the step-{step} checkpoint failed")
        if dist.get_rank() == 0:
            _write_manifest(manifest, partial)

    request = AsyncRequest(staged.write_all, (outcome[1],), [complete])
    background.submit(request, step, root, size)
    return Path(root) / iteration_name(step)


def _save_files(trainer, partial: Path, engine=None) -> None:
    """DeepSpeed's save_checkpoint into `partial`, through `engine` (a CheckpointEngine) if given."""
    original = trainer.engine.checkpoint_engine
    if engine is not None:
        trainer.engine.checkpoint_engine = engine
    try:
        # the entry DeepSpeed's universal converter wants: it lets a resume change the DP size
        trainer.engine.save_checkpoint(str(partial.parent), tag=partial.name, save_latest=False,
                                       client_state=universal.client_state_entry())
    finally:
        trainer.engine.checkpoint_engine = original


def _manifest(trainer, step: int, fingerprint: dict) -> dict:
    """The manifest's common state, taken when the save is made."""
    import deepspeed

    cfg = trainer.cfg
    return {
        "format": "deepspeed",
        "deepspeed_version": deepspeed.__version__,
        "common": {
            "engine": "deepspeed",
            "step": step,
            "scheduler": trainer.scheduler.state_dict(),
            "settings": settings(cfg.zero, cfg.precision, trainer.layout.dp),
            "seed": cfg.train.seed,
            "model": cfg.model.name,
            "model_config": OmegaConf.to_container(cfg.model, resolve=True),
        },
        "logits_digest": fingerprint,
    }


def _write_manifest(manifest: dict, partial: Path) -> None:
    """Rank 0, once every rank has written: the manifest with each file's size."""
    files = {str(f.relative_to(partial)): f.stat().st_size for f in sorted(partial.rglob("*")) if f.is_file()}
    write_text_atomic(partial / DEEPSPEED_MANIFEST, json.dumps(manifest | {"files": files}, indent=1))


def _on_host(obj):
    """`obj` with every tensor in its dicts, lists and tuples detached and, on a GPU, copied
    to host memory (what the writer will write: training may change the originals). A
    non-blocking copy to the CPU lands in pinned memory, which the copy engine fills at
    full speed; the caller synchronizes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", non_blocking=True) if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, dict):  # an OrderedDict stays one (module state dicts are)
        out = {k: _on_host(v) for k, v in obj.items()}
        return collections.OrderedDict(out) if isinstance(obj, collections.OrderedDict) else out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def _write_failed(reader) -> BaseException | None:
    """What this rank's writer reported: None when it wrote every file (a writer that sent
    nothing died)."""
    if not reader.poll(5.0):
        return CheckpointError("this rank's checkpoint writer ended without writing its files")
    result = reader.recv()
    return None if result is None else result


class StagedFiles:
    """A DeepSpeed checkpoint engine that writes nothing while DeepSpeed saves: each file's
    state is kept (its tensors copied to host memory on CUDA; on CPU the writer's fork is
    the copy) and `write_all`, run in the forked writer, writes them as DeepSpeed's own
    engine would (torch.save). Loading, directories and commits stay the original's."""

    def __init__(self, original):
        self.original = original
        self.files: list[tuple[object, str]] = []

    def __getattr__(self, name):
        return getattr(self.original, name)

    def save(self, state_dict, path: str) -> None:
        self.files.append((_on_host(state_dict), path))
        if torch.cuda.is_available():  # the copies were made without waiting (into pinned memory)
            torch.cuda.synchronize()

    def write_all(self, outcome) -> None:
        try:
            for state, path in self.files:
                self.original.save(state, path)
            outcome.send(None)
        except BaseException as e:  # the training process raises it, on every rank
            outcome.send(OSError(e.errno, f"{e.strerror or e}: {getattr(e, 'filename', '')}") if isinstance(e, OSError)
                         else CheckpointError(f"{type(e).__name__}: {e}"))


def resumes_through_universal(checkpoint, zero, precision, dp: int) -> bool:
    """Whether this run resumes a checkpoint saved at another data-parallel size (DeepSpeed
    must then be configured, before it starts, to load the universal form)."""
    ck = checkpoint
    if not (ck.load and holds_checkpoints(ck.load)):
        return False
    path = checkpoint_to_load(ck.load, ck.fallback)
    if path is None or engine_of(path) != "deepspeed":
        return False
    return resharding(read_common(path)["settings"], settings(zero, precision, dp)) == "universal"


def universal_copy(path: Path, job_dir: Path) -> Path:
    """`path` in DeepSpeed's universal form, made once by rank 0 under `job_dir` (which every
    rank must see, as it sees the checkpoint) and published by a rename: a conversion killed
    halfway leaves nothing that loads. One extract and one merge worker: no process pool."""
    final = job_dir / "universal_checkpoints" / path.name
    if dist.get_rank() == 0 and not final.is_dir():
        with scratch_directory(final) as tmp:
            converted = subprocess.run(
                guarded_module_command(universal.CONVERTER, universal.converter_args(path, tmp / final.name)),
                capture_output=True, text=True)
            if converted.returncode != 0:
                raise CheckpointError(f"DeepSpeed's universal conversion of {path} failed: {converted.stderr[-2000:]}")
            os.replace(tmp / final.name, final)
        print(f"checkpoint  {path} saved at another data-parallel size: converted to DeepSpeed's universal "
              f"form in {final}", flush=True)
    dist.barrier()
    return final


def load(trainer, root: str | os.PathLike, job_dir: str | os.PathLike,
         fallback: bool = False) -> tuple[int, Path, str | None]:
    """Restore model, optimizer, schedule and step from the newest checkpoint under `root`
    (with `fallback`, the newest intact one); returns the step to continue from, the
    checkpoint loaded, and the line saying how this run's config changed the learning-rate
    schedule (None: unchanged). A checkpoint saved at another data-parallel size is converted into
    `job_dir`, the one directory every rank shares. Validation has refused what this would
    refuse; a job launched elsewhere (Slurm, torchrun lines) meets the same checks here."""
    path = checkpoint_to_load(root, fallback)
    if path is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    if engine_of(path) != "deepspeed":
        raise CheckpointError(f"{path} was written by the Megatron engine; engine=deepspeed resumes only its own "
                              "checkpoints (convert it to a Hugging Face folder to start from its weights).")
    refuse_pickled_code_on_every_rank(path)  # before an upstream reader touches a file
    common = read_common(path)
    cfg = trainer.cfg
    diffs = model_differences(common["model_config"], cfg.model)
    if diffs:
        raise CheckpointError(f"{path} was written for another model shape: {', '.join(diffs)}")
    wanted = settings(cfg.zero, cfg.precision, trainer.layout.dp)
    how = resharding(common["settings"], wanted)
    if how == "refuse":
        raise CheckpointError(f"{path} was saved with DeepSpeed settings {common['settings']}; this run has {wanted}")
    source = path
    if how == "universal":
        if not trainer.engine.load_universal_checkpoint():
            raise CheckpointError(f"{path} needs the universal load, which this engine was not configured for")
        source = universal_copy(path, Path(job_dir))
    loaded, _ = trainer.engine.load_checkpoint(str(source.parent), tag=source.name, load_lr_scheduler_states=False)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {source}")
    if how == "universal" and cfg.zero.stage == 3:
        saved = load_torch_file(universal.optimizer_state_file(source))
        universal.restore_zero3_param_groups(trainer.engine.optimizer, saved)  # DeepSpeed's defects
    set_adam_form(trainer.engine.optimizer, cfg.engine.fused_adam)  # the loaded groups carry the saver's form
    schedule_change = restore_schedule(trainer.scheduler, common["scheduler"], int(common["step"]))
    return int(common["step"]), path, schedule_change
