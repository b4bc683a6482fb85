"""Run the job now on this machine: torchrun with one process per GPU (or CPU rank)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from .environment import worker_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(cfg, job_dir: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={cfg.cluster.gpus_per_node}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m", "gridwright.worker", "--job-dir", str(job_dir),
    ]


def run_local(cfg, job_dir: Path, extra_env: dict[str, str]) -> int:
    """Start torchrun and wait for it; returns its exit code."""
    env = dict(os.environ)
    env.update(worker_env(cfg))
    env.update(extra_env)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = torchrun_command(cfg, job_dir, free_port())
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode
