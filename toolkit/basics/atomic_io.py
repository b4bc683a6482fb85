"""Atomic writes: a reader sees the old file (or directory) or the new one, never half of one."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process's umask. Linux tells it in /proc; elsewhere reading it means setting it
    (and straight back), which other threads could notice, so /proc comes first."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write to a temporary file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's file is private; the result should not be
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


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then the directories, to disk (before the rename
    that publishes them, so a power loss cannot leave a published but empty file)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why `path` could not be created or written (its nearest existing folder is on a
    read-only file system or not writable by this user), or None: checked before work."""
    folder = Path(path).resolve()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        try:
            readonly = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        except OSError:
            readonly = False
        return f"{folder} is on a read-only file system" if readonly else f"{folder} is not writable by this user"
    return None


def _stage_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_stale_stages(final: str | os.PathLike) -> list[Path]:
    """Remove the staging folders that conversions to `final` left behind when they were
    killed (their process, named in the folder's name, no longer runs on this host). A
    previous output moved aside by a conversion killed before its rename goes back."""
    import psutil

    final, removed = Path(final), []
    host = socket.gethostname()
    for path in final.parent.glob(f".{final.name}.*"):
        match = re.fullmatch(re.escape(f".{final.name}.") + r"(.+)-(\d+)\.[^.]+\.(partial|old)", path.name)
        if not match or match.group(1) != host or psutil.pid_exists(int(match.group(2))):
            continue
        if match.group(3) == "old" and (path / "previous").exists() and not os.path.lexists(final):
            os.replace(path / "previous", final)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def scratch_directory(final: str | os.PathLike):
    """Yield a temporary directory beside `final` (on its filesystem, where there is room
    for what is being made), removed on exit; named like a stage, so that a killed
    process's scratch is removed by the next `remove_stale_stages(final)`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.{_stage_tag()}.", suffix=".partial"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary directory beside `final`; rename it to `final` on success.

    On any error the temporary directory is removed and `final` is untouched. Without
    `overwrite`, an existing `final` is an error, checked before anything is written and
    again at the rename (something may have appeared meanwhile). With it, the old `final`
    is moved aside, and deleted only once the new one is in place (restored if that fails).
    """
    final = Path(final)
    if os.path.lexists(final) and not overwrite:
        raise FileExistsError(f"{final} already exists; pass --overwrite to replace it.")
    final.parent.mkdir(parents=True, exist_ok=True)
    # Named after this process, so that a later conversion can tell a dead one's leftovers.
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.{_stage_tag()}.", suffix=".partial"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the output should not be
    old, committed = None, False
    try:
        yield tmp
        _fsync_tree(tmp)
        if os.path.lexists(final):
            if not overwrite:
                raise FileExistsError(f"{final} appeared while it was being written; nothing was replaced.")
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.{_stage_tag()}.", suffix=".old"))
            os.replace(final, old / "previous")
        try:
            os.replace(tmp, final)
            committed = True
        except BaseException:
            if old is not None:
                os.replace(old / "previous", final)
                old.rmdir()
                old = None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
        if committed and old is not None:  # never delete the previous output before the new one is in place
            shutil.rmtree(old, ignore_errors=True)
