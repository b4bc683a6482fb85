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


def checkpoint_bytes(cfg) -> int:
    """The size of one checkpoint of this run, estimated."""
    n = param_counts(cfg.model).total
    weights = _DTYPE_BYTES.get(cfg.precision.params_dtype, 4)
    masters = 4 if weights != 4 else 0
    return int(n * (weights + masters + 8) * 1.25)


def saves_kept(cfg) -> int:
    """How many checkpoints of this run are on disk at once, at most (one more is being
    written while the oldest kept one waits for the new one to be published)."""
    ck, steps = cfg.checkpoint, cfg.train.steps
    saves = steps // ck.save_interval + (steps % ck.save_interval != 0) if ck.save_interval else 1
    return min(saves, ck.keep_last + 1) if ck.keep_last else saves


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds `path` (or would, once created)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def space_problem(cfg) -> str | None:
    """Why `checkpoint.save` cannot hold this run's checkpoints, or None."""
    root = cfg.checkpoint.save
    need = checkpoint_bytes(cfg) * saves_kept(cfg)
    free = free_bytes(root)
    if free >= need:
        return None
    return (f"checkpoint.save={root} has {size_text(free)} free, but this run keeps up to {saves_kept(cfg)} "
            f"checkpoint(s) of about {size_text(checkpoint_bytes(cfg))} there ({size_text(need)}). Fix: free "
            "space, save elsewhere, save less often (checkpoint.save_interval) or keep fewer (checkpoint.keep_last=N).")


class DiskFull(OSError):
    """A save that failed because its file system is full, said so."""


def no_space_message(root: str | os.PathLike, needed: int) -> str:
    return (f"no space left on {root}: a checkpoint needs about {size_text(needed)}, "
            f"{size_text(free_bytes(root))} free. The previous checkpoint is intact. Fix: free space, or save "
            "elsewhere (checkpoint.save) and keep fewer (checkpoint.keep_last=N).")


def is_disk_full(error: BaseException, root: str | os.PathLike, needed: int) -> bool:
    """Whether a failed save ran out of space: an ENOSPC or EDQUOT anywhere in the error's
    chain, or a file system left with less than a checkpoint's size (torch's zip writer
    reports a full disk as 'unexpected pos N vs M', with no errno)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return free_bytes(root) < needed
    except OSError:
        return False
