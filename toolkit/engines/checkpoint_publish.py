"""How both engines publish a checkpoint, so that a kill at any moment leaves the previous
one as the one that loads: every rank writes into `iter_N.partial/`; once all have
finished, rank 0 renames it to `iter_N/` and only then points `latest` at it (atomically).
A `.partial` left by a killed save is removed by the next save of that step."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from ..atomic_io import write_text_atomic
from ..checkpoint_dir import LATEST, iteration_name


@contextlib.contextmanager
def staged_iteration(root: str | os.PathLike, step: int) -> Iterator[Path]:
    """Collective: yields the `.partial` directory to write the checkpoint of `step` into;
    on leaving, publishes it as `root/iter_N` (see the module docstring)."""
    root = Path(root)
    final = root / iteration_name(step)
    partial = root / (iteration_name(step) + ".partial")
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # left by a save that was killed
            shutil.rmtree(partial)
        partial.mkdir()
    dist.barrier()
    yield partial
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        write_text_atomic(root / LATEST, final.name + "\n")
    dist.barrier()
