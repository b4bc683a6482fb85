"""Run the job now on this machine: the agent (torchrun) with one process per GPU or CPU rank.

The launcher owns the run's processes: the agent follows it through a pipe (a SIGINT or
SIGTERM here is passed on once as a `stop` line: the workers stop after their current
step and save; the pipe's end, when the launcher dies even by SIGKILL, stops the agent
too), and whatever of the run still lives when the agent returns is ended. The
rendezvous and gloo listen on 127.0.0.1 only.
"""
from __future__ import annotations

import os
import signal
import subprocess
import socket
import sys
import time
from pathlib import Path

from ..runtime.process_tree import TOKEN_ENV, end_run_processes, new_token

from ..runtime.loopback import LOOPBACK, LOOPBACK_SOCKETS, free_port
from .agent import LAUNCHER_PIPE_ENV, LOOPBACK_BACKEND, STOP_LINE
from .environment import worker_env



# How long the agent may sit stopped before the launcher ends the job. A stopped agent
# never resumes by itself; the bound leaves room for a deliberate `kill -STOP`/`-CONT`.
AGENT_STOPPED_BOUND_S = 15


def agent_command(cluster, launcher, job_dir: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "gridwright.launchers.agent", "--job-dir", str(job_dir),
        "--nnodes=1",
        f"--nproc_per_node={cluster.gpus_per_node}",
        f"--rdzv-backend={LOOPBACK_BACKEND}",
        f"--rdzv-endpoint={LOOPBACK}:{port}",
        "--rdzv-conf=rank=0",
        f"--max-restarts={launcher.max_restarts}",
    ]


def run_local(cfg, job_dir: Path) -> tuple[int, int | None, str | None]:
    """Start the agent and wait for it; returns its exit code, the signal that stopped the
    launcher (None when none did), and why the launcher ended a stuck agent (or None)."""
    token = new_token()
    env = dict(os.environ)
    env.update(worker_env(cfg))
    env.update({TOKEN_ENV: token, LAUNCHER_PIPE_ENV: "1", **LOOPBACK_SOCKETS})
    cmd = agent_command(cfg.cluster, cfg.launcher, job_dir, free_port())
    print("+ " + " ".join(cmd), flush=True)
    # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which passes
    # it on once; a second signal to torchrun mid-shutdown would cut the workers' save.
    agent = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.PIPE, text=True)
    received: list[int] = []

    def pass_on(signum, frame):
        if not received:
            print(f"launcher    signal {signum}: stopping the run after the current step", file=sys.stderr,
                  flush=True)
            try:
                agent.stdin.write(STOP_LINE + "\n")
                agent.stdin.flush()
            except OSError:  # the agent has ended already
                pass
        received.append(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    lost = None
    try:
        lost = wait_watching(agent)
        if lost:
            print(f"launcher    {lost}: ending the job", file=sys.stderr, flush=True)
            end_run_processes(token)  # SIGKILL reaches a stopped process too
        code = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        agent.stdin.close()
        end_run_processes(token)
    return code, (received[0] if received else None), lost


def wait_watching(agent: subprocess.Popen) -> str | None:
    """Wait for the agent; None when it ends, or why it never will: stopped (SIGSTOP, a
    debugger) for AGENT_STOPPED_BOUND_S. Its workers may have finished and wait, as
    zombies, for an agent that no longer runs: nothing else would end the job."""
    import psutil

    stopped_since = None
    while agent.poll() is None:
        try:
            state = psutil.Process(agent.pid).status()
        except psutil.Error:  # ended between the poll and the look
            state = None
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            stopped_since = stopped_since or time.monotonic()
            if time.monotonic() - stopped_since >= AGENT_STOPPED_BOUND_S:
                return (f"the agent on node 0 ({socket.gethostname()}, pid {agent.pid}) has been stopped for "
                        f"{AGENT_STOPPED_BOUND_S} s (state: {state})")
        else:
            stopped_since = None
        time.sleep(0.5)
    return None
