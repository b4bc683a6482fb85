"""Checkpoint saves that training does not wait for (`checkpoint.async_save`), for both engines.

A save stages the state (on CUDA, a copy in host memory; on CPU the fork below is the
copy) and hands an `AsyncRequest` to Megatron-Core's `AsyncCallsQueue`, which forks a
writer process per save (its TemporalAsyncCaller) and returns to training. Each rank asks
after every step whether every rank's writer has ended (one all-reduce, as Megatron-LM's
training loop does); then the request's finalize functions run on every rank: the
engine's own (Megatron's `.metadata`; DeepSpeed's manifest), then the publication
(`checkpoint_publish.publish_iteration`: `iter_N.partial` renamed, `latest` moved,
`keep_last` applied). Until then `latest` names the previous checkpoint, so a kill of a
worker, its agent or the launcher mid-write loses only the save under way, and keep_last
never sees the `.partial` being written.

Why a forked process, not a thread: the write pickles and copies gigabytes, and a thread
would take the GIL from the training loop; a fork also freezes the state as it was at
the save, so training may change it at once. Megatron-Core's DeepSpeed counterpart
(DeepSpeed's DecoupledCheckpointEngine) needs its async-I/O extension built, which
DS_BUILD_OPS=0 does not, so the DeepSpeed engine stages its files through a checkpoint
engine of its own (`deepspeed_checkpoint`) and uses this same queue.

The writer is tied to its rank: it dies with it (a parent-death signal kills the writer's
process group, Megatron's per-file writers included), and the watchdog bounds a write as
it bounds a save: 5 x the last write's time, the first by the checkpoint's size, never below
`watchdog.save_floor_s` and at most `watchdog.phase_timeout_s` (`heartbeat.save_bound_s`,
`heartbeat.Heartbeat.writing`).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoints.checkpoint_dir import CheckpointError, tree_bytes
from ..megatron_internals.cpu_compat import cpu_compat
from ..planning.disk_space import size_text
from ..runtime.heartbeat import NO_PROGRESS
from .checkpoint_publish import discard_iteration, publish_iteration, saying_when_full

_PR_SET_PDEATHSIG = 1
_PARENT_GONE = signal.SIGUSR2  # the writer's parent-death signal: it then ends its process group


def _write_in_background(write, *args, **kwargs):
    """The writer process's entry (forked from the rank): its own process group, which it
    kills when the rank dies, so that Megatron's per-file writers (its children) end too;
    SIGTERM and SIGINT are left to the rank, which waits for the write with a bound (Slurm
    signals every process of a job step)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(_PARENT_GONE, lambda *_: os.killpg(0, signal.SIGKILL))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(_PARENT_GONE), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the rank died before the call above
        os.killpg(0, signal.SIGKILL)
    return write(*args, **kwargs)


@dataclass
class _Pending:
    step: int
    root: Path
    needed_bytes: int
    staged_s: float  # how long training stood still for this save
    started: float
    # host memory the staging took in this process: the copies of GPU tensors (on CPU the fork
    # shares the pages, and training's changes copy them: up to this rank's part of the checkpoint)
    staged_bytes: int = 0


class BackgroundSaves:
    """One rank's background checkpoint writes: at most one at a time (a save that comes
    while one is written waits for it or is skipped, `checkpoint.async_busy`). Every method
    that may finalize is collective: call it on every rank at the same point."""

    def __init__(self, checkpoint_cfg, device: torch.device, write_bound_s, progress=NO_PROGRESS):
        """`write_bound_s(last_write_s)`: how long a write may take (heartbeat.save_bound_s)."""
        self.cfg = checkpoint_cfg
        self._bound_after = write_bound_s
        self.device = device
        self.progress = progress
        self.says = dist.get_rank() == 0
        self._queue = None
        self._pending: _Pending | None = None
        # Megatron-Core's queue asks torch.cuda for a device and a synchronize; on CPU (the
        # DeepSpeed engine too) its CPU stand-ins answer
        self._compat = cpu_compat if device.type == "cpu" else contextlib.nullcontext
        self.published: list[dict] = []  # one record per published background save

    @property
    def busy(self) -> bool:
        return self._pending is not None

    @property
    def last_write_s(self) -> float | None:
        """The last published write's time (the next write's bound); None before the first."""
        return self.published[-1]["write_s"] if self.published else None

    @property
    def bound_s(self) -> float:
        """How long the next (or the pending) write may take before it counts as stalled."""
        return self._bound_after(self.last_write_s)

    def submit(self, request, step: int, root, needed_bytes: int) -> None:
        """Collective: start writing `request` (an AsyncRequest whose finalize functions
        complete the checkpoint's files) into `root`'s `.partial` of `step`; publication is
        added as its last finalize function."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)
        if request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(_write_in_background, request.async_fn))
        request.add_finalize_fn(functools.partial(publish_iteration, root, step, self.cfg.keep_last))
        self._pending = _Pending(step, Path(root), needed_bytes, 0.0, time.perf_counter())
        with self._compat():
            self._queue.schedule_async_request(request)
        self.progress.writing(step, self._writer_pid(), self.bound_s)

    def staged_for(self, seconds: float, grew_bytes: int) -> None:
        """How long training stood still for the pending save (staging and the fork), and
        how much this process grew meanwhile (the staged copies)."""
        if self._pending is not None:
            self._pending.staged_s, self._pending.staged_bytes = seconds, max(0, grew_bytes)

    def _writer(self):
        if self._queue is None or not self._queue.async_calls:
            return None
        return self._queue.async_calls[0].async_caller.process

    def _writer_pid(self) -> int | None:
        proc = self._writer()
        return proc.pid if proc is not None else None

    def poll(self) -> None:
        """Collective: publish the pending checkpoint if every rank's writer has ended."""
        if self._pending is not None:
            self._finalize(blocking=False)

    def before_save(self, step: int) -> bool:
        """Collective, before the save of `step`: whether to save it. With a write under way,
        `checkpoint.async_busy=wait` waits for it (and says how long), `skip` skips this save."""
        self.poll()
        if self._pending is None:
            return True
        if self.cfg.async_busy == "skip":
            if self.says:
                print(f"checkpoint  step {step} not saved: the step-{self._pending.step} checkpoint is still being "
                      "written (checkpoint.async_busy=skip)", flush=True)
            return False
        started = time.perf_counter()
        pending = self._pending.step
        self._finalize(blocking=True)
        if self.says:
            print(f"checkpoint  step {step} waited {time.perf_counter() - started:.1f} s for the step-{pending} "
                  "checkpoint's background write (checkpoint.async_busy=wait)", flush=True)
        return True

    def finish(self, bound_s: float, why: str) -> None:
        """Collective, at the end of training or at a stop: wait for the pending write, at
        most `bound_s`; past it every rank abandons the write (its `.partial` is removed
        and `latest` keeps the previous checkpoint) and says so."""
        deadline = time.monotonic() + bound_s
        while self._pending is not None:
            proc = self._writer()
            alive = proc is not None and proc.is_alive()
            anyone_alive, anyone_expired = self._vote(alive, time.monotonic() > deadline)
            if not anyone_alive:
                self._finalize(blocking=False)
            elif anyone_expired:
                self._abandon(bound_s, why)
            else:
                time.sleep(0.05)

    def _vote(self, alive: bool, expired: bool) -> tuple[bool, bool]:
        flags = torch.tensor([int(alive), int(expired)], dtype=torch.int, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _finalize(self, blocking: bool) -> None:
        pending = self._pending
        started = time.perf_counter()
        try:
            with saying_when_full(pending.root, pending.needed_bytes), self._compat():
                done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except Exception as e:
            self._pending = None
            self.progress.written()
            discard_iteration(pending.root, pending.step)
            if isinstance(e, OSError):
                raise
            raise CheckpointError(f"the background write of the step-{pending.step} checkpoint to {pending.root} "
                                  f"failed: {e}; the previous checkpoint is intact") from e
        if not done:
            return
        self._pending = None
        self.progress.written()
        write_s = time.perf_counter() - pending.started
        stall_s = pending.staged_s + (time.perf_counter() - started)  # staging, then the publication
        path = pending.root / f"iter_{pending.step:07d}"
        record = {"step": pending.step, "stall_s": stall_s, "write_s": write_s,
                  "staged_bytes": pending.staged_bytes}
        if self.says:
            size = tree_bytes(path)
            record["bytes"] = size
            print(f"checkpoint  saved {path} in the background: written in {write_s:.1f} s "
                  f"({size_text(size)}, {size / max(write_s, 1e-3) / 1e6:.0f} MB/s); training stood "
                  f"{stall_s:.2f} s for it", flush=True)
        self.published.append(record)

    def _abandon(self, bound_s: float, why: str) -> None:
        pending = self._pending
        proc = self._writer()
        if proc is not None and proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self._queue.close(abort=True)
        self._queue = None
        self._pending = None
        self.progress.written()
        dist.barrier()
        discard_iteration(pending.root, pending.step)
        if self.says:
            print(f"checkpoint  the step-{pending.step} checkpoint's background write did not end within "
                  f"{bound_s:.0f} s of {why}: abandoned; latest still names the previous checkpoint",
                  file=sys.stderr, flush=True)
