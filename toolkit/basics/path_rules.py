"""One rule for the paths gridwright reads and writes: only regular files and directories
inside the root they belong to. A symbolic link out of the root, a FIFO, a device, a
socket or anything under /proc, /sys or /dev is refused with one line naming the path and
what it is (PathRefused), before anything is opened in a way that could block, follow a
link or read without end.

Opening goes through `os.open` with O_NOFOLLOW and O_NONBLOCK, then `fstat` on the open
descriptor: what is read is what was checked (no window between a check and the open),
a FIFO never blocks the open, and a link is never followed. Reads are bounded by what the
file must hold; nothing here echoes a file's content.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# Directories no run writes into (their own files or anything under the first three).
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys",
               "/usr", "/var")
_NEVER_INSIDE = ("/proc", "/sys", "/dev")


class PathRefused(ValueError):
    """A path is not a regular file or directory inside its root; the message says which."""


def what_is(path: str | os.PathLike) -> str:
    """What sits at `path`, without following a final link: 'a regular file', 'a FIFO',
    'a symbolic link to /x', 'nothing' ..."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "nothing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {os.readlink(path)}"
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path`, every link resolved, lies in `root` (resolved)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def system_place(path: str | os.PathLike) -> str | None:
    """Why `path` is no place for a run's files (a system directory, or under /proc, /sys,
    /dev), or None."""
    real = os.path.realpath(path)
    if real in SYSTEM_DIRS:
        return f"{path} is the system directory {real}"
    for top in _NEVER_INSIDE:
        if Path(real).is_relative_to(top):
            return f"{path} is under {top}"
    return None


def entry_problem(path: str | os.PathLike, root: str | os.PathLike, kind: str = "file") -> str | None:
    """Why `path` may not be read or written as a `kind` ('file' or 'directory') of `root`,
    or None: it must be a regular file (directory) itself, not a link, inside `root`."""
    want = "a regular file" if kind == "file" else "a directory"
    found = what_is(path)
    if found == want and inside(path, root):
        return None
    if found == want:
        return f"{path} lies outside {root}: refused"
    return f"{path} is {found}, not {want} of {root}: refused"


def check_entry(path: str | os.PathLike, root: str | os.PathLike, kind: str = "file") -> Path:
    problem = entry_problem(path, root, kind)
    if problem:
        raise PathRefused(problem)
    return Path(path)


def model_folder_file(folder: str | os.PathLike, name: str) -> Path:
    """`name` of a Hugging Face model folder, as a path that may be read: a plain file name
    (no '/', no '..'), a regular file, or a link to one inside the folder or into the Hub
    cache's blob store that the folder is a snapshot of (`models--*/snapshots/REV/` links
    each file to `../../blobs/HASH`). Anything else raises PathRefused; a plain name that
    is absent raises FileNotFoundError."""
    folder = Path(folder)
    path = folder / name
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise PathRefused(f"'{name[:200]}' is not a file name of {folder}: refused (a model folder's index lists "
                          "file names in its own folder)")
    found = what_is(path)
    if found == "nothing":
        raise FileNotFoundError(path)
    if found.startswith("a symbolic link"):
        real = Path(os.path.realpath(path))
        if inside(path, folder) or real.is_relative_to(folder.resolve().parent.parent / "blobs"):
            found = what_is(real)
    if found != "a regular file":
        raise PathRefused(f"{path} is {found}, not a regular file of {folder}: refused")
    return path


def open_followed(path: str | os.PathLike) -> int:
    """A descriptor on a regular file a checked link leads to (model_folder_file); never
    blocking on a FIFO swapped in since."""
    fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathRefused(f"{path} is {what_is(os.path.realpath(path))}, not a regular file: refused")
    os.set_blocking(fd, True)
    return fd


def tree_problem(directory: str | os.PathLike) -> str | None:
    """The first entry under `directory` (one checkpoint) that is not a regular file or a
    directory, or None. Links are not followed: an iteration holds its own files only."""
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            path = os.path.join(dirpath, name)
            found = what_is(path)
            if found not in ("a regular file", "a directory"):
                return f"{path} is {found}, not a regular file of {directory}: refused"
    return None


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor on `path`, which must be a regular file: never through a link, never
    blocking on a FIFO. Raises PathRefused naming what it is instead."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            raise PathRefused(f"{path} is {what_is(path)}, not a regular file: refused") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathRefused(f"{path} is {what_is(path)}, not a regular file: refused")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: str | os.PathLike, limit: int, what: str, follow: bool = False) -> bytes:
    """The bytes of the regular file `path`, which holds `what` and so at most `limit`
    bytes; a larger file is refused by its size, unread. `follow`: `path` is a link
    already checked (model_folder_file)."""
    fd = open_followed(path) if follow else open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise PathRefused(f"{path} is {size} bytes; {what} takes at most {limit}: refused")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # grew while read
            raise PathRefused(f"{path} holds more than {limit} bytes; {what} takes at most {limit}: refused")
        return data
    finally:
        os.close(fd)


def read_bounded_text(path: str | os.PathLike, limit: int, what: str, follow: bool = False) -> str:
    try:
        return read_bounded(path, limit, what, follow).decode()
    except UnicodeDecodeError:
        raise PathRefused(f"{path} is not text; it should hold {what}: refused") from None
