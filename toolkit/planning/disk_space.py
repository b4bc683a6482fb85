"""How much disk a run's checkpoints take, and what a save that finds the disk full says.

A checkpoint holds every parameter in the training precision and Adam's state in fp32
(two moments, plus fp32 master weights when training in 16 bits); both engines write
about that, whatever the layout, plus their indexes and pickled objects: a quarter more
covers them (measured on the tiny model: 2.8 MiB on disk, 2.4 MiB of tensors).
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .model_math import param_counts

GIB = 1024**3
MIB = 1024**2
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def size_text(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / MIB:,.1f} MiB"


def checkpoint_bytes(model, precision) -> int:
    """The size of one checkpoint of this run, estimated."""
    n = param_counts(model).total
    weights = _DTYPE_BYTES.get(precision.params_dtype, 4)
    masters = 4 if weights != 4 else 0
    return int(n * (weights + masters + 8) * 1.25)


def saves_kept(checkpoint, train, first_step: int = 0) -> int:
    """How many checkpoints this run adds to its file system at the most, from
    `first_step` on (a resume): with `keep_last`, the kept ones plus the one being written
    before the oldest is removed."""
    ck, steps = checkpoint, train.steps
    every = ck.save_interval or steps
    due = {s for s in range(every, steps + 1, every) if s > first_step} | ({steps} if steps > first_step else set())
    return min(len(due), ck.keep_last + 1) if ck.keep_last else len(due)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds `path` (or would, once created)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def space_problem(cfg, first_step: int = 0, already_kept: int = 0) -> str | None:
    """Why `checkpoint.save` cannot hold this run's checkpoints, or None. A resume passes
    its `first_step` and how many checkpoints the save root holds that retention counts."""
    root = cfg.checkpoint.save
    count = saves_kept(cfg.checkpoint, cfg.train, first_step)
    if cfg.checkpoint.keep_last:
        count = max(min(count, 1), count - already_kept)
    one = checkpoint_bytes(cfg.model, cfg.precision)
    need = one * count
    free = free_bytes(root)
    if free >= need:
        return None
    return (f"checkpoint.save={root} has {size_text(free)} free, but this run adds up to {count} checkpoint(s) "
            f"of about {size_text(one)} there ({size_text(need)}). Fix: free space, save "
            "elsewhere, save less often (checkpoint.save_interval) or keep fewer (checkpoint.keep_last=N).")


class DiskFull(OSError):
    """A save that failed because its file system is full, said so."""


def no_space_message(root: str | os.PathLike, needed: int) -> str:
    return (f"no space left on {root}: a checkpoint needs about {size_text(needed)}, "
            f"{size_text(free_bytes(root))} free. The previous checkpoint is intact. Fix: free space, or save "
            "elsewhere (checkpoint.save) and keep fewer (checkpoint.keep_last=N).")


def is_disk_full(error: BaseException, root: str | os.PathLike, needed: int) -> bool:
    """Whether a failed save ran out of space: an ENOSPC or EDQUOT anywhere in the error's
    chain, or torch's zip writer's 'unexpected pos' (how it reports a write cut short by a
    full disk, with no errno) on a file system left with less than a checkpoint's size."""
    seen, texts = error, []
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        texts.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    if not any("unexpected pos" in t or "No space left" in t for t in texts):
        return False
    try:
        return free_bytes(root) < needed
    except OSError:
        return False
