"""How both engines publish a checkpoint, so that a kill at any moment leaves the previous
one as the one that loads: every rank writes into `iter_N.partial/`; once all have
finished, rank 0 renames it to `iter_N/` and only then points `latest` at it (atomically).
A `.partial` left by a killed save is removed by the next save of that step. A save that
fills the disk says so (disk_space.DiskFull); `keep_last` removes older checkpoints once
the new one is published, never the one `latest` names nor one being written."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from ..basics.atomic_io import write_text_atomic
from ..checkpoints.checkpoint_dir import LATEST, iteration_name, iterations, latest_name, step_of
from ..planning.disk_space import DiskFull, is_disk_full, no_space_message


@contextlib.contextmanager
def staged_iteration(root: str | os.PathLike, step: int, keep_last: int = 0, needed_bytes: int = 0) -> Iterator[Path]:
    """Collective: yields the `.partial` directory to write the checkpoint of `step` into;
    on leaving, publishes it as `root/iter_N` and keeps the newest `keep_last` (0: all;
    see the module docstring). `needed_bytes`, one checkpoint's estimated size, is what a
    full disk is measured against."""
    partial = open_iteration(root, step)
    with saying_when_full(root, needed_bytes):
        yield partial
    publish_iteration(root, step, keep_last)


def open_iteration(root: str | os.PathLike, step: int) -> Path:
    """Collective: the empty `.partial` directory the checkpoint of `step` is written into
    (a background save writes it while training goes on; `publish_iteration` ends it)."""
    root = Path(root)
    partial = root / (iteration_name(step) + ".partial")
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(partial):  # left by a save that was killed
            _clear(partial)
        partial.mkdir()
    dist.barrier()
    return partial


@contextlib.contextmanager
def saying_when_full(root: str | os.PathLike, needed_bytes: int) -> Iterator[None]:
    """A save's failure for want of space becomes DiskFull, said in one line."""
    try:
        yield
    except Exception as e:
        if is_disk_full(e, root, needed_bytes):
            raise DiskFull(no_space_message(root, needed_bytes)) from e
        raise


def publish_iteration(root: str | os.PathLike, step: int, keep_last: int = 0) -> Path:
    """Collective, once every rank has written its files into the `.partial` directory:
    rank 0 renames it to `iter_N`, points `latest` at it, then applies `keep_last`."""
    root = Path(root)
    final = root / iteration_name(step)
    partial = root / (iteration_name(step) + ".partial")
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.lexists(final):
            _clear(final)
        os.replace(partial, final)
        write_text_atomic(root / LATEST, final.name + "\n")
        if keep_last:
            remove_older(root, keep_last)
    dist.barrier()
    return final


def discard_iteration(root: str | os.PathLike, step: int) -> None:
    """Rank 0 removes the `.partial` of a save that failed or was abandoned (a full disk
    gets its space back; `latest` never named it)."""
    partial = Path(root) / (iteration_name(step) + ".partial")
    if dist.get_rank() == 0 and os.path.lexists(partial):
        _clear(partial)


def _clear(path: Path) -> None:
    """Remove a `.partial` or `iter_N` this save is about to replace. A link there (which
    validation refuses before start) is unlinked, never followed: nothing outside the root
    is touched."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def remove_older(root: Path, keep_last: int) -> list[Path]:
    """Keep the checkpoint `latest` names (just published) and the newest `keep_last - 1`
    before it; remove the older ones. Checkpoints of later steps than `latest` (left by a
    run that was rolled back) are not counted and not touched, nor is a `.partial`, nor a
    link (`iterations` lists real directories only). The new checkpoint is published
    before this runs, so a removal that fails is said in one line naming the path, and
    training goes on."""
    kept = step_of(latest_name(root))
    before = [p for p in iterations(root) if step_of(p) < kept]
    gone = before[: max(0, len(before) - (keep_last - 1))]
    for path in gone:
        try:
            shutil.rmtree(path)
        except OSError as e:
            print(f"checkpoint  could not remove {path} (checkpoint.keep_last={keep_last}): {e.strerror or e}; "
                  "training goes on", file=sys.stderr, flush=True)
    return gone
