"""Emit one command per node, the node's agent (torchrun, static rendezvous on node 0), to
run by any means. Re-running them on the same job directory resumes the job (from the
newest checkpoint in checkpoint.save, into the same MLflow run).

Each line is read by a shell: the environment values and every argument (the interpreter
and the job directory may hold spaces, quotes, unicode) go through shlex.quote."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from gridwright.basics.atomic_io import write_text_atomic

from .environment import worker_env

COMMANDS_FILE = "torchrun_commands.sh"


def node_command(cfg, job_dir: Path, node_rank: int) -> str:
    """Node `node_rank`'s line: `K=V ... python -m gridwright.launchers.agent ...`."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(worker_env(cfg).items()))
    args = [
        cfg.launcher.python or sys.executable, "-m", "gridwright.launchers.agent", "--job-dir", str(job_dir),
        f"--nnodes={cfg.cluster.nodes}",
        f"--nproc_per_node={cfg.cluster.gpus_per_node}",
        f"--node_rank={node_rank}",
        f"--master_addr={cfg.launcher.master_addr}",
        f"--master_port={cfg.launcher.master_port}",
    ]
    return f"{env} {shlex.join(args)}"


def emit_torchrun(cfg, job_dir: Path) -> Path:
    lines = [
        "#!/usr/bin/env bash",
        f"# {cfg.name}: run line N on node N ({cfg.cluster.nodes} nodes). The job directory",
        "# must be on a file system every node sees.",
    ]
    lines += [f"# node {i}\n{node_command(cfg, job_dir, i)}" for i in range(cfg.cluster.nodes)]
    return write_text_atomic(job_dir / COMMANDS_FILE, "\n".join(lines) + "\n")
