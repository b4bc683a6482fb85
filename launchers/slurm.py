"""Write an sbatch script: one srun task per node, each starting the node's agent (torchrun).

Static rendezvous with `--node_rank=$SLURM_NODEID` (not c10d, which numbers nodes in
the order they join) so that host index N of the printed placement is the N-th node of
the allocation, as `scontrol show hostnames` lists it. The head node's address is what
that node itself reports (`hostname --ip-address`, run there by srun, as TorchTitan's
and NeMo-Run's scripts do): node names need not resolve on the other nodes.

The script is requeue-safe: a requeued job re-runs it on the same job directory, and the
workers resume from the newest checkpoint into the same MLflow run (gridwright.launchers.worker).
Each node's output goes to its own file, `slurm-<job>-node<N>.out`, lines labelled.

Quoting: job directories and interpreters may hold spaces, quotes, unicode. The `#SBATCH`
lines are read by sbatch, not by a shell (see `directive_value`); everything below them
by bash, so every path and value there goes through shlex.quote.
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from gridwright.basics.atomic_io import write_text_atomic

from .environment import worker_env

SCRIPT_FILE = "job.sbatch"

# Characters sbatch reads as themselves in an `#SBATCH` line (ASCII only, to be safe).
_PLAIN_DIRECTIVE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def directive_value(key: str, value) -> str:
    """`value` as one word of an `#SBATCH` line. sbatch (src/sbatch/opt.c, checked with
    Slurm 22.05) splits these lines at whitespace, groups '...' or "...", takes a backslash
    as escaping the next character and an unquoted `#` as the start of a comment; it
    expands nothing. So a value other than plain characters is written in double quotes,
    with `\\` and `"` escaped. A line break ends the line whatever the quoting: refused.
    `key` is the config key the value came from, for the message."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise ValueError(f"{key}={text!r}: an #SBATCH line cannot hold a line break; choose a value without one")
    if _PLAIN_DIRECTIVE.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_file(job_dir: Path, name: str) -> str:
    """The --output file `name` (a Slurm filename pattern: %j, %n...) in the job directory.
    Slurm expands `%` in the whole name, so the directory's own `%` are doubled; a backslash
    in the name turns every pattern off and is itself dropped (slurmstepd, 22.05), so a job
    directory holding one cannot be written: refused."""
    text = str(job_dir)
    if "\\" in text:
        raise ValueError(f"job_dir={text!r}: Slurm's --output drops backslashes from file names "
                         "(and then ignores %j); choose a job directory without one")
    return f"{text.replace('%', '%%')}/{name}"


def gpu_directive(launcher, cluster) -> str | None:
    """How the job asks for GPUs: `auto` is --gpus-per-node on CUDA clusters and nothing on
    CPU ones; `gres` is the older --gres=gpu:N form; `none` leaves it to the partition."""
    form, c = launcher.gpu_request, cluster
    if form == "auto":
        form = "gpus_per_node" if c.device == "cuda" else "none"
    return {"gpus_per_node": f"--gpus-per-node={c.gpus_per_node}", "gres": f"--gres=gpu:{c.gpus_per_node}",
            "none": None}[form]


def directives(cfg, job_dir: Path) -> list[str]:
    c, lcfg = cfg.cluster, cfg.launcher

    def opt(option: str, key: str, value) -> str:
        return f"--{option}={directive_value(key, value)}"

    out = [opt("job-name", "name", cfg.name), f"--nodes={c.nodes}", "--ntasks-per-node=1", gpu_directive(lcfg, c)]
    if lcfg.exclusive:
        out.append("--exclusive")
    out += [opt("time", "launcher.time_limit", lcfg.time_limit),
            opt("output", "job_dir", output_file(job_dir, "slurm-%j.out")), "--open-mode=append", "--requeue"]
    for option, key in (("partition", "partition"), ("account", "account"), ("qos", "qos"),
                        ("constraint", "constraint"), ("cpus-per-task", "cpus_per_task"), ("mem", "mem")):
        if lcfg[key] is not None:
            out.append(opt(option, f"launcher.{key}", lcfg[key]))
    for extra in lcfg.extra_directives:  # already in sbatch's syntax: written as given
        if "\n" in extra or "\r" in extra:
            raise ValueError(f"launcher.extra_directives: {extra!r} holds a line break; give one directive per item")
        out.append(extra)
    return [f"#SBATCH {d}" for d in out if d]


def agent_command(python: str, job_dir: Path, gpus_per_node: int) -> str:
    """The agent's command line for the `bash -c` that srun starts on each node. The node's
    numbers are variables, expanded there (the outer script quotes this line as a whole)."""
    return (f"{shlex.quote(python)} -m gridwright.launchers.agent --job-dir {shlex.quote(str(job_dir))} "
            f"--nnodes=$SLURM_NNODES --nproc_per_node={gpus_per_node} --node_rank=$SLURM_NODEID "
            "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT")


def container_options(image: str | None, job_dir: Path) -> str:
    """Pyxis options: the image, and the job directory mounted at its own path. Pyxis splits
    --container-mounts at `,` (mounts) and `:` (source, target, flags): a job directory
    holding either cannot be mounted, refused."""
    if not image:
        return ""
    if set(str(job_dir)) & {",", ":"}:
        raise ValueError(f"job_dir={str(job_dir)!r}: pyxis' --container-mounts cannot hold ',' or ':'; "
                         "choose a job directory without them, or no launcher.container_image")
    mount = f"{job_dir}:{job_dir}"
    return f" --container-image={shlex.quote(image)} --container-mounts={shlex.quote(mount)}"


def sbatch_script(cfg, job_dir: Path) -> str:
    """The script's text; ValueError where a value cannot be written in it (names the key)."""
    c, lcfg = cfg.cluster, cfg.launcher
    python = lcfg.python or sys.executable  # recorded at plan time: sbatch's PATH may differ
    header = ["#!/bin/bash", *directives(cfg, job_dir)]
    body = [
        "set -euo pipefail",
        *(["# set-up (launcher.setup)", *lcfg.setup.rstrip().splitlines()] if lcfg.setup else []),
        f"# Planned placement (rank -> node, GPU, coordinates): {job_dir}/placement.csv",
        f"export GRIDWRIGHT_PLACEMENT={shlex.quote(f'{job_dir}/placement.json')}",
        *[f"export {k}={shlex.quote(v)}" for k, v in sorted(worker_env(cfg).items())],
        # awk reads the whole list: `head -n 1` may exit before scontrol has written it all,
        # and scontrol's SIGPIPE, under pipefail, ends the script (seen with 3000 nodes).
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')',
        'MASTER_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | awk \'{print $1}\')',
        f"export MASTER_ADDR MASTER_PORT={shlex.quote(str(lcfg.master_port))}",
        'echo "gridwright  job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES node(s), '
        'head $HEAD_NODE ($MASTER_ADDR:$MASTER_PORT)"',
    ]
    node_output = shlex.quote(output_file(job_dir, "slurm-%j-node%n.out"))
    agent = shlex.quote(agent_command(python, job_dir, c.gpus_per_node))
    body.append(f"srun --kill-on-bad-exit=1 --label --output={node_output} --open-mode=append"
                f"{container_options(lcfg.container_image, job_dir)} bash -c {agent}")
    return "\n".join([*header, "", *body]) + "\n"


def emit_slurm(cfg, job_dir: Path) -> Path:
    return write_text_atomic(job_dir / SCRIPT_FILE, sbatch_script(cfg, job_dir))
