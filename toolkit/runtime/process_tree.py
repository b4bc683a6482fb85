"""A run's processes on one host: marked, tied to their parent, and ended together.

torchrun starts each worker in a session of its own and, when a worker dies, signals only
the workers still alive; a worker's own children (compile pools, data loaders) outlive
it. So every process of a run carries a token in its environment (children inherit it),
and whoever ends the run on a host ends every process with that token. `die_with_parent`
ties a worker to its agent, so that a SIGKILL of the agent cannot leave it training.

psutil reads the process table; prctl has no binding in the
standard library, so the one call it needs goes through ctypes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import uuid

import psutil

TOKEN_ENV = "GRIDWRIGHT_RUN_TOKEN"
_PR_SET_PDEATHSIG = 1


def new_token() -> str:
    return uuid.uuid4().hex


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent ends (Linux only);
    a parent already gone means this process is an orphan: it gets `sig` now."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing ties the process to its parent
        return
    if parent == 1 or not psutil.pid_exists(parent):
        os.kill(os.getpid(), sig)


def processes_with_token(token: str, exclude: set[int] = frozenset()) -> list[psutil.Process]:
    """Processes of this user whose environment carries `token` (their environment is
    readable only by their owner, which the run's processes are)."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        try:
            if proc.environ().get(TOKEN_ENV) == token:
                out.append(proc)
        except (psutil.Error, OSError):  # gone meanwhile, a zombie, or another user's
            continue
    return out


def end_processes(procs: list[psutil.Process], grace_s: float = 10.0) -> list[psutil.Process]:
    """SIGTERM, then SIGKILL whatever still runs after `grace_s`; returns those that were
    still alive at the SIGKILL."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return alive


def end_run_processes(token: str, grace_s: float = 10.0) -> int:
    """End every process of this host that carries `token` except this one and its
    ancestors; returns how many there were."""
    me = psutil.Process()
    keep = {me.pid, *(p.pid for p in me.parents())}
    procs = processes_with_token(token, exclude=keep)
    end_processes(procs, grace_s)
    return len(procs)


def end_descendants(grace_s: float = 5.0) -> None:
    """End this process's children and their children (a worker's last act)."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    end_processes(procs, grace_s)


def exit_at_once(code: int) -> None:
    """End the process now without running destructors: after a CUDA run, tearing down its
    NCCL groups or CUDA state has hung (launchers.worker says where). Output is flushed and
    child processes ended first, as a normal exit would."""
    sys.stdout.flush()
    sys.stderr.flush()
    end_descendants()
    os._exit(code)


def run_bounded(cmd: list[str], timeout: float | None, grace_s: float = 60.0, **popen) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` whose timeout ends the whole
    process tree, not only `cmd`: `subprocess.run`'s own timeout kills the one child and then
    waits for the output pipes, which a surviving grandchild (a torchrun worker) holds open,
    so a hung worker hung its caller too. Past `timeout`: SIGTERM to every descendant, then
    SIGKILL after `grace_s`, and the CompletedProcess has exit code 124 and says so."""
    proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        _end_tree(proc.pid, grace_s)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out, (err or "") + f"\n[timed out after {timeout:.0f} s]")
    except BaseException:  # the caller is interrupted (Ctrl-C, a test's timeout): the tree ends with it
        _end_tree(proc.pid, grace_s=5.0)
        raise


def _end_tree(pid: int, grace_s: float) -> None:
    try:
        head = psutil.Process(pid)
        tree = [head, *head.children(recursive=True)]
    except psutil.Error:  # it ended just now
        tree = []
    end_processes(tree, grace_s=grace_s)
