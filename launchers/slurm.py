"""Write an sbatch script: one srun task per node, each starting the node's agent (torchrun).

Static rendezvous with `--node_rank=$SLURM_NODEID` (not c10d, which numbers nodes in
the order they join) so that host index N of the printed placement is the N-th node of
the allocation, as `scontrol show hostnames` lists it. The head node's address is what
that node itself reports (`hostname --ip-address`, run there by srun, as TorchTitan's
and NeMo-Run's scripts do): node names need not resolve on the other nodes.

The script is requeue-safe: a requeued job re-runs it on the same job directory, and the
workers resume from the newest checkpoint into the same MLflow run (gridwright.worker).
Each node's output goes to its own file, `slurm-<job>-node<N>.out`, lines labelled.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from gridwright.atomic_io import write_text_atomic

from .environment import worker_env

SCRIPT_FILE = "job.sbatch"


def gpu_directive(cfg) -> str | None:
    """How the job asks for GPUs: `auto` is --gpus-per-node on CUDA clusters and nothing on
    CPU ones; `gres` is the older --gres=gpu:N form; `none` leaves it to the partition."""
    form, c = cfg.launcher.gpu_request, cfg.cluster
    if form == "auto":
        form = "gpus_per_node" if c.device == "cuda" else "none"
    return {"gpus_per_node": f"--gpus-per-node={c.gpus_per_node}", "gres": f"--gres=gpu:{c.gpus_per_node}",
            "none": None}[form]


def directives(cfg, job_dir: Path) -> list[str]:
    c, lcfg = cfg.cluster, cfg.launcher
    out = [f"--job-name={cfg.name}", f"--nodes={c.nodes}", "--ntasks-per-node=1", gpu_directive(cfg)]
    if lcfg.exclusive:
        out.append("--exclusive")
    out += [f"--time={lcfg.time_limit}", f"--output={job_dir}/slurm-%j.out", "--open-mode=append", "--requeue"]
    for key, value in (("partition", lcfg.partition), ("account", lcfg.account), ("qos", lcfg.qos),
                       ("constraint", lcfg.constraint), ("cpus-per-task", lcfg.cpus_per_task), ("mem", lcfg.mem)):
        if value is not None:
            out.append(f"--{key}={value}")
    out += list(lcfg.extra_directives)
    return [f"#SBATCH {d}" for d in out if d]


def sbatch_script(cfg, job_dir: Path) -> str:
    c, lcfg = cfg.cluster, cfg.launcher
    python = lcfg.python or sys.executable  # recorded at plan time: sbatch's PATH may differ
    body = [
        "set -euo pipefail",
        *(["# set-up (launcher.setup)", *lcfg.setup.rstrip().splitlines()] if lcfg.setup else []),
        f"# Planned placement (rank -> node, GPU, coordinates): {job_dir}/placement.csv",
        f"export GRIDWRIGHT_PLACEMENT={job_dir}/placement.json",
        *[f"export {k}={v}" for k, v in sorted(worker_env(cfg).items())],
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'MASTER_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | awk \'{print $1}\')',
        f"export MASTER_ADDR MASTER_PORT={lcfg.master_port}",
        'echo "gridwright  job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES node(s), '
        'head $HEAD_NODE ($MASTER_ADDR:$MASTER_PORT)"',
    ]
    container = (f" --container-image={lcfg.container_image} --container-mounts={job_dir}:{job_dir}"
                 if lcfg.container_image else "")
    agent = (f"{shlex.quote(python)} -m gridwright.launchers.agent --job-dir {shlex.quote(str(job_dir))} "
             f"--nnodes=$SLURM_NNODES --nproc_per_node={c.gpus_per_node} --node_rank=$SLURM_NODEID "
             "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT")
    body.append(f"srun --kill-on-bad-exit=1 --label --output={job_dir}/slurm-%j-node%n.out --open-mode=append"
                f"{container} bash -c '{agent}'")
    return "\n".join(["#!/bin/bash", *directives(cfg, job_dir), "", *body]) + "\n"


def emit_slurm(cfg, job_dir: Path) -> Path:
    return write_text_atomic(job_dir / SCRIPT_FILE, sbatch_script(cfg, job_dir))
