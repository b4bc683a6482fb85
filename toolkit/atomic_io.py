"""Atomic writes: a reader sees the old file (or directory) or the new one, never half of one."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write to a temporary file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary directory beside `final`; rename it to `final` on success.

    On any error the temporary directory is removed and `final` is untouched. With
    `overwrite`, an existing `final` is moved aside first and deleted only after the new
    one is in place. Without it, an existing `final` is an error before anything is written.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists; pass --overwrite to replace it.")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".old"))
        os.replace(final, old / "previous")
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
