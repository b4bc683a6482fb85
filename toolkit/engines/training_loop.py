"""The one training loop, for every engine: resume, steps, the profiling window,
evaluation, checkpoint saves, the agreed stop, step metrics and memory records.

An engine supplies a trainer (`protocol.Trainer`) through its `open_trainer`; everything
that happens between steps happens here, so a feature built here exists on every engine,
and the numbers of two engines are taken by the same code.
"""
from __future__ import annotations

import importlib
import time

import psutil
import torch.distributed as dist

from ..checkpoints.checkpoint_dir import CheckpointError, holds_checkpoints, latest_checkpoint, tree_bytes
from ..planning.disk_space import GIB, checkpoint_bytes, size_text
from ..planning.layout import cp_exchange
from ..planning.save_mode import saves_in_background
from ..runtime.heartbeat import NO_PROGRESS, save_bound_s
from ..runtime.profiling import ProfileWindow
from ..runtime.step_metrics import timed_step, write_memory_record
from . import attention_kernels
from .background_saves import BackgroundSaves
from ..engine_rules.registry import rules


def run_training(cfg, layout, on_step, on_start=None, job_dir=None, stop=None, progress=None) -> dict:
    """Train `cfg.train.steps` steps on `cfg.engine.name`; `on_step(step, metrics)` runs on
    the logging rank. With `stop` (a StopRequest), a signal ends training after the step
    every rank is at, saving a checkpoint first when `checkpoint.save` is set. `progress`
    (a Heartbeat) hears of every step and phase on every rank. Returns facts for the
    summary: which attention kernel ran and why (attention_kernels) and, with
    engine.compile_layers, how many graphs torch.compile made in this process (0 would mean
    nothing compiled), whichever engine compiled its layers."""
    progress = progress or NO_PROGRESS
    engine = importlib.import_module(f"{__package__}.{rules(cfg.engine).TRAINER_MODULE}")
    with engine.open_trainer(cfg, layout, job_dir) as trainer:
        attention = _choose_attention(cfg, layout, trainer, job_dir)
        with attention_kernels.use(attention):
            saves = _loop(cfg, trainer, on_step, on_start, job_dir, stop, progress)
        facts = {"attention": attention.facts(), **trainer.run_facts()}
        if saves:
            facts["checkpoint_saves"] = saves
    if cfg.engine.compile_layers:
        from ..torch_internals.dynamo import compiled_graphs

        facts["compiled_graphs"] = compiled_graphs()
    return facts


def _choose_attention(cfg, layout, trainer, job_dir) -> attention_kernels.AttentionChoice:
    """This run's attention kernel; a restarted job keeps its first attempt's."""
    from .megatron_model import DTYPES

    earlier = attention_kernels.remembered(job_dir)
    if earlier is not None:
        return earlier
    exchange = cp_exchange(cfg.parallel, cfg.model, cfg.data, cfg.cluster.device == "cuda")
    shape = attention_kernels.attention_shape(cfg.model, cfg.train, layout, exchange)
    choice = attention_kernels.choose(cfg.engine.attention_backend, shape, DTYPES[cfg.precision.params_dtype],
                                      trainer.device, packed=bool(cfg.data.packing),
                                      transformer_engine=trainer.spec_name.startswith("transformer_engine"))
    if dist.get_rank() == 0:
        attention_kernels.remember(choice, job_dir)
    return choice


def _loop(cfg, trainer, on_step, on_start, job_dir, stop, progress) -> list[dict]:
    """The steps; returns one record per checkpoint saved: how long training stood still
    for it and, for a background save, how long its write took."""
    rank = dist.get_rank()
    ck = cfg.checkpoint
    first_step = 0
    if ck.load:
        if rank == 0:
            _announce_large_load(ck)
        started = time.perf_counter()
        resumed = trainer.load(job_dir)
        if resumed is not None:
            first_step = resumed.first_step
            if rank == 0:
                print(f"checkpoint  loaded {resumed.path} in {time.perf_counter() - started:.1f} s "
                      f"({size_text(tree_bytes(resumed.path))}); {resumed.what}", flush=True)
                if resumed.schedule_change:
                    print(f"resume      {resumed.schedule_change}", flush=True)
    if on_start is not None:
        on_start(trainer)
    on_cuda = cfg.cluster.device == "cuda"
    window = ProfileWindow(cfg.evaluate, cfg.cluster, job_dir or ".", rank)
    every = cfg.data.eval_interval
    saves = _SaveLines(cfg)
    def save_bound(previous_s: float | None) -> float:
        return save_bound_s(checkpoint_bytes(cfg.model, cfg.precision), previous_s, cfg.watchdog.save_floor_s)

    def write_bound(previous_s: float | None) -> float:  # a stalled write is found within the phase bound
        return min(save_bound(previous_s), cfg.watchdog.phase_timeout_s)

    background = BackgroundSaves(ck, trainer.device, write_bound, progress) \
        if ck.save and saves_in_background(ck, cfg.cluster.device) else None
    records = []
    last_save_s = None  # the previous save's time: the next one's bound (heartbeat.save_bound_s)
    signal = None
    for step in range(first_step, cfg.train.steps):
        window.before_step(step)
        metrics = timed_step(trainer.train_step, step, on_cuda)
        progress.step_done(step, metrics["step_time_s"])
        writes_trace = window.writes_after(step)
        if writes_trace:  # a large trace takes minutes to write
            progress.phase("profiling")
        window.after_step(step, metrics["step_time_s"])
        if writes_trace:
            progress.phase("training")
        done = step + 1
        if every and (done % every == 0 or done == cfg.train.steps):
            progress.phase("evaluating")  # its first forward-only pass may compile for minutes
            metrics["val_loss"] = trainer.evaluate(done // every)
            progress.phase("training")
        if background is not None:
            background.poll()  # publishes a background save once every rank's writer has ended
        if trainer.is_logging_rank:
            on_step(step, metrics)
        due = done == cfg.train.steps or (ck.save_interval and done % ck.save_interval == 0)
        signal = stop.agreed(trainer.device) if stop is not None else None
        if ck.save and (due or signal):
            # a background write under way may be waited for: its own last time bounds that
            bound = background.bound_s if background is not None and background.busy else save_bound(last_save_s)
            progress.phase("saving", bound)
            last = done == cfg.train.steps or signal is not None  # written at once: nothing trains after it
            started, rss = time.perf_counter(), psutil.Process().memory_info().rss  # a wait for a write counts
            if background is not None and last:
                background.finish(bound, "the end of training" if signal is None else f"signal {signal}")
            if background is None or last or background.before_save(done):
                if background is not None:
                    # A wait for the previous write (above) spent its own bound: this save gets one
                    # of its own, a last one as long as a background write takes (the same bytes).
                    progress.phase("saving", save_bound((background.last_write_s or last_save_s) if last
                                                        else last_save_s))
                if rank == 0:
                    saves.announce(done)
                path = trainer.save(done, ck.save, None if last else background)
                last_save_s = time.perf_counter() - started
                if background is None or last:
                    records.append({"step": done, "background": False, "stall_s": last_save_s,
                                    "bytes": tree_bytes(path) if rank == 0 else None})
                    if rank == 0:
                        saves.done(path, last_save_s)
                else:
                    background.staged_for(last_save_s, psutil.Process().memory_info().rss - rss)
                    if rank == 0:
                        saves.staged(done, last_save_s)
            progress.phase("training")
        if signal:
            if rank == 0:
                print(f"stopped     by signal {signal} after step {step}"
                      + ("" if ck.save else " (no checkpoint: checkpoint.save is not set)"), flush=True)
            break
    if background is not None:  # a run that ends without a last save (nothing left to train)
        background.finish(background.bound_s, "the end of training")
        records += [dict(r, background=True) for r in background.published]
    progress.phase("finishing")
    if job_dir is not None:  # every rank's peak, for the estimate-vs-measured record
        write_memory_record(job_dir, rank, on_cuda)
    dist.barrier()
    return sorted(records, key=lambda r: r["step"])


# A checkpoint larger than this gets a line before its save or load starts (they take
# minutes); every save and load gets one line after, with its time and size.
LARGE_CHECKPOINT = GIB


def _announce_large_load(ck) -> None:
    """Before a long load: which checkpoint, and how big."""
    if not holds_checkpoints(ck.load):
        return  # a Hugging Face folder (initial weights) or nothing yet
    try:
        path = latest_checkpoint(ck.load)
    except CheckpointError:
        return  # the load itself says what is wrong, on every rank
    size = tree_bytes(path) if path is not None else 0
    if size > LARGE_CHECKPOINT:
        print(f"checkpoint  loading {path} ({size_text(size)})", flush=True)


class _SaveLines:
    """The save lines of rank 0: after each save its time and size; before a large one, its
    estimated size and, from the second save on, the time the last save's rate gives."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.bytes_per_s: float | None = None

    def announce(self, step: int) -> None:
        size = checkpoint_bytes(self.cfg.model, self.cfg.precision)
        if size <= LARGE_CHECKPOINT:
            return
        eta = f", est. {size / self.bytes_per_s:.0f} s at the last save's rate" if self.bytes_per_s else ""
        print(f"checkpoint  saving step {step} to {self.cfg.checkpoint.save}: about {size_text(size)}{eta}",
              flush=True)

    def staged(self, step: int, seconds: float) -> None:
        print(f"checkpoint  staged step {step} in {seconds:.2f} s; writing it in the background", flush=True)

    def done(self, path, seconds: float) -> None:
        size = tree_bytes(path)
        self.bytes_per_s = size / max(seconds, 1e-3)
        print(f"checkpoint  saved {path} in {seconds:.1f} s ({size_text(size)})", flush=True)
