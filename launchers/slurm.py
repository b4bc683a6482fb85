"""Write an sbatch script: one srun task per node, each starting torchrun.

Static rendezvous with `--node_rank=$SLURM_NODEID` (not c10d, which numbers nodes in
the order they join) so that host index N of the printed placement is the N-th node of
the allocation, as `scontrol show hostnames` lists it.
"""
from __future__ import annotations

from pathlib import Path

from gridwright.atomic_io import write_text_atomic

from .environment import worker_env

SCRIPT_FILE = "job.sbatch"


def sbatch_script(cfg, job_dir: Path) -> str:
    c, lcfg = cfg.cluster, cfg.launcher
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={c.gpus_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --time={lcfg.time_limit}",
        f"#SBATCH --output={job_dir}/slurm-%j.out",
    ]
    if lcfg.partition:
        head.append(f"#SBATCH --partition={lcfg.partition}")
    if lcfg.account:
        head.append(f"#SBATCH --account={lcfg.account}")
    body = [
        "set -euo pipefail",
        f"# Planned placement (rank -> node, GPU, coordinates): {job_dir}/placement.csv",
        f"export GRIDWRIGHT_PLACEMENT={job_dir}/placement.json",
        *[f"export {k}={v}" for k, v in sorted(worker_env(cfg).items())],
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        f"export MASTER_PORT={lcfg.master_port}",
    ]
    container = f" --container-image={lcfg.container_image} --container-mounts={job_dir}:{job_dir}" if lcfg.container_image else ""
    body.append(
        f"srun --kill-on-bad-exit=1{container} bash -c '{lcfg.python} -m torch.distributed.run "
        f"--nnodes=$SLURM_NNODES --nproc_per_node={c.gpus_per_node} --node_rank=$SLURM_NODEID "
        "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT "
        f"-m gridwright.worker --job-dir {job_dir}'"
    )
    return "\n".join(head + [""] + body) + "\n"


def emit_slurm(cfg, job_dir: Path) -> Path:
    return write_text_atomic(job_dir / SCRIPT_FILE, sbatch_script(cfg, job_dir))
