"""The rules of the config's own values: declared choices, counts, numbers and names, the
tested releases, the engine's refusals, checkpoints, the launcher, tracking and evaluation.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from omegaconf import OmegaConf
from ..families.hf_config import fitting_family
from ..engine_rules.registry import is_known, rules
from ..planning.layout import ParallelLayout
from ..config.schema import declared_choices
from ..runtime.machine_probe import probe
from ..versions.megatron_version import refusal as megatron_core_refusal
from ..versions.torch_version import refusal as torch_refusal


# Rules ----------------------------------------------------------------------
def check_choices(cfg) -> list[str]:
    """Every field whose choices the schema declares holds one of them (one pass over the
    schema), and the ranges of the few integer settings."""
    out = []
    for path, value, allowed, nullable in declared_choices(cfg):
        if value is None and nullable:
            continue
        if value not in allowed:
            # a family by the model's shape (its experts and fixed values)
            near = fitting_family(dict(cfg.model)) if path == "model.family" else _nearest_choice(str(value), allowed)
            out.append(f"{path}='{value}' is not one of {', '.join(allowed)}{' (or null)' if nullable else ''}. "
                       f"Fix: {path}={near}.")
    if cfg.train.warmup_steps < 0:
        out.append(f"train.warmup_steps={cfg.train.warmup_steps} must be 0 (no warm-up) or positive. "
                   f"Fix: train.warmup_steps={max(0, cfg.train.steps // 10)}.")
    elif cfg.train.warmup_steps >= cfg.train.steps >= 1:
        out.append(
            f"train.warmup_steps={cfg.train.warmup_steps} must be below train.steps={cfg.train.steps} "
            f"(the cosine decay needs steps after the warm-up). Fix: train.warmup_steps={cfg.train.steps // 10}."
        )
    if cfg.zero.stage not in (0, 1, 2, 3):
        out.append(f"zero.stage={cfg.zero.stage} must be 0, 1, 2 or 3. Fix: zero.stage={min(max(cfg.zero.stage, 0), 3)}.")
    if cfg.launcher.max_restarts < 0:
        out.append(f"launcher.max_restarts={cfg.launcher.max_restarts} must be 0 or more. Fix: launcher.max_restarts=0.")
    return out


def _nearest_choice(value: str, allowed) -> str:
    """The choice `value` begins, else the one nearest in spelling."""
    begun = [a for a in allowed if a.startswith(value)]
    return (begun or difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.0) or [allowed[0]])[0]


def check_counts(model, train, cluster) -> list[str]:
    """Sizes that every layout computation divides by."""
    out = []
    for path, v in (
        ("cluster.nodes", cluster.nodes),
        ("cluster.gpus_per_node", cluster.gpus_per_node),
        ("cluster.nvlink_domain_size", cluster.nvlink_domain_size),
        ("train.steps", train.steps),
        ("train.micro_batch_size", train.micro_batch_size),
        ("train.global_batch_size", train.global_batch_size),
        ("train.seq_length", train.seq_length),
        ("train.log_interval", train.log_interval),
        ("model.num_layers", model.num_layers),
        ("model.hidden_size", model.hidden_size),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.num_query_groups", model.num_query_groups),
        ("model.vocab_size", model.vocab_size),
        ("model.max_position_embeddings", model.max_position_embeddings),
        ("model.moe_router_topk", model.moe_router_topk),
    ):
        if v < 1:
            out.append(f"{path}={v} must be at least 1.")
    if model.head_dim is not None and model.head_dim < 1:
        out.append(f"model.head_dim={model.head_dim} must be at least 1 (or null: hidden_size / heads).")
    if model.num_experts < 0:
        out.append(f"model.num_experts={model.num_experts} must be 0 (dense) or more.")
    return out


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def check_numbers(cfg) -> list[str]:
    """Real numbers that must be finite, and positive or at least zero where the schema
    means it: a NaN or infinite learning rate trains to NaN and reports FINISHED."""
    t, m, w, out = cfg.train, cfg.model, cfg.watchdog, []
    positive = [("train.lr", t.lr), ("model.norm_epsilon", m.norm_epsilon), ("model.rotary_base", m.rotary_base),
                ("watchdog.stall_factor", w.stall_factor), ("watchdog.min_stall_s", w.min_stall_s),
                ("watchdog.phase_timeout_s", w.phase_timeout_s)]
    if m.rope_scaling_factor is not None:
        positive.append(("model.rope_scaling_factor", m.rope_scaling_factor))
    if w.collective_timeout_s is not None:
        positive.append(("watchdog.collective_timeout_s", w.collective_timeout_s))
    at_least_zero = [("train.min_lr", t.min_lr), ("train.weight_decay", t.weight_decay),
                     ("train.grad_clip", t.grad_clip), ("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff),
                     ("cluster.inter_node_gbps", cfg.cluster.inter_node_gbps),
                     ("cluster.gpu.memory_gib", cfg.cluster.gpu.memory_gib),
                     ("cluster.gpu.peak_bf16_tflops", cfg.cluster.gpu.peak_bf16_tflops),
                     ("cluster.gpu.peak_fp8_tflops", cfg.cluster.gpu.peak_fp8_tflops)]
    for path, v in positive:
        if not (_finite(v) and v > 0):
            out.append(f"{path}={v} must be a finite number above 0.")
    for path, v in at_least_zero:
        if not (_finite(v) and v >= 0):
            out.append(f"{path}={v} must be a finite number, 0 or more.")
    if not out and t.min_lr > t.lr:
        out.append(f"train.min_lr={t.min_lr} must not exceed train.lr={t.lr} (the schedule decays towards it).")
    if cfg.data.weights is not None and not all(_finite(x) and x >= 0 for x in cfg.data.weights):
        out.append(f"data.weights={list(cfg.data.weights)} must be finite numbers, 0 or more.")
    return out


NAME_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]*")


def check_paths(cfg) -> list[str]:
    """`name` becomes one directory under `job_root` (and the MLflow run's name): it must
    not leave it. Explicit paths are the user's to choose, but a NUL or newline fits in no
    file name an emitted script can quote. No run writes into a system directory."""
    from ..basics.path_rules import system_place

    out = []
    if cfg.name is not None and not NAME_CHARS.fullmatch(str(cfg.name)):
        out.append(f"name={cfg.name!r} must be one directory name: letters, digits and ._+=,@- (not starting "
                   "with one of those), no '/' or '..'. Fix: name=my_run.")
    for key in ("job_root", "job_dir", "checkpoint.save", "checkpoint.load"):
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if "\0" in str(value) or "\n" in str(value):
            out.append(f"{key}={value!r} holds a NUL or newline character, which no path or script can carry.")
        elif key == "job_root" and str(value).strip() == "":
            out.append("job_root='' names no directory (jobs would land in the directory launch.py runs from). "
                       "Fix: job_root=jobs.")
        elif key in ("job_root", "job_dir") and system_place(value):
            out.append(f"{key}={value}: {system_place(value)}, no place for a run's files. "
                       + ("Fix: job_root=jobs." if key == "job_root" else f"Fix: {key}=null."))
    return out


def check_tested_releases(launcher, for_launch: bool) -> list[str]:
    """The installed Megatron-Core and torch must be tested releases (a local launch runs on
    this machine; other launchers' workers check their own: at import of megatron_internals,
    and torch's in launchers.worker)."""
    if not (for_launch and launcher.name == "local"):
        return []
    return [problem for problem in (megatron_core_refusal(), torch_refusal()) if problem]


def check_engine(cfg, layout: ParallelLayout, for_launch: bool) -> list[str]:
    """The engine's own refusals (gridwright.engines.<name>_rules), and what no engine runs."""
    if not is_known(cfg.engine):
        return []  # check_choices says so
    out = rules(cfg.engine).problems(cfg, layout, for_launch)
    if cfg.cluster.device == "cpu" and cfg.parallel.moe_token_dispatcher == "alltoall" and cfg.model.num_experts:
        out.append(
            "parallel.moe_token_dispatcher=alltoall creates a CUDA stream in Megatron-Core 0.16.1 and cannot "
            "run on cpu. Fix: parallel.moe_token_dispatcher=allgather."
        )
    return out


def check_checkpoint(cfg) -> list[str]:
    from pathlib import Path

    from ..checkpoints.checkpoint_dir import LATEST, root_problem, writer_problem
    from ..basics.path_rules import system_place

    ck, out = cfg.checkpoint, []
    if ck.keep_last < 0:
        out.append(f"checkpoint.keep_last={ck.keep_last} must be 0 (keep every checkpoint) or positive.")
    if not (ck.save or ck.load):
        return out
    if ck.save_interval < 0:
        out.append(f"checkpoint.save_interval={ck.save_interval} must be 0 (end only) or positive.")
    if is_known(cfg.engine):
        out += rules(cfg.engine).checkpoint_problems(cfg)
    if ck.save and system_place(ck.save):
        return out + [f"checkpoint.save={ck.save}: {system_place(ck.save)}, no place for a run's checkpoints. "
                      "Fix: save into a directory of your own."]
    for root in sorted({ck.save, ck.load} - {None, ""}):
        problem = root_problem(root)
        if problem:  # the load root's are said with the rest of it (checkpoint_dir.describe_problem)
            out += [problem] if root != ck.load else []
            continue
        problem = writer_problem(root) if cfg.launcher.name == "local" else None
        if problem:
            out.append(problem)
    if ck.save and cfg.launcher.name == "local":
        from ..basics.atomic_io import unwritable_reason
        from ..planning.disk_space import space_problem

        problem = unwritable_reason(ck.save)
        if problem:
            out.append(f"checkpoint.save={ck.save} cannot be written: {problem}.")
        elif ck.keep_last >= 0 and ck.save_interval >= 0:
            problem = space_problem(cfg, *_resume_point(ck))
            if problem:
                out.append(problem)
    if ck.save and (Path(ck.save) / LATEST).exists():
        from ..runtime.jobdir import same_job

        same = (ck.load and Path(ck.load).resolve() == Path(ck.save).resolve()) or (
            cfg.job_dir and cfg.launcher.name == "local" and same_job(cfg, Path(cfg.job_dir)))
        if not same:
            out.append(
                f"checkpoint.save={ck.save} already holds checkpoints of another run; gridwright does not "
                f"mix runs. Fix: checkpoint.load={ck.save} to resume that run, or save elsewhere."
            )
    return out


def _resume_point(checkpoint) -> tuple[int, int]:
    """(the step a run resumes after, how many checkpoints its save root holds): a resume
    adds only the saves still to come, and retention counts those already there."""
    from pathlib import Path

    from ..checkpoints.checkpoint_dir import CheckpointError, holds_checkpoints, iterations, latest_checkpoint, step_of

    ck = checkpoint
    held = len(iterations(ck.save)) if Path(ck.save).is_dir() else 0
    try:
        if ck.load and not ck.weights_only and holds_checkpoints(ck.load):
            latest = latest_checkpoint(ck.load)
            return (step_of(latest) if latest else 0), held
    except CheckpointError:
        pass  # reported by the checkpoint checks
    return 0, held


def check_launcher(launcher, cluster, for_launch: bool) -> list[str]:
    if launcher.name != "local":
        return []
    if cluster.nodes > 1:
        return [
            f"launcher=local runs on this machine only, but cluster.nodes={cluster.nodes}. "
            "Fix: launcher=torchrun or launcher=slurm (or launcher=plan to inspect)."
        ]
    if for_launch and cluster.device == "cuda":
        facts = probe()
        if facts.cuda_devices < cluster.gpus_per_node:
            found = (f"this machine has {facts.cuda_devices} CUDA device(s) (torch {facts.torch})"
                     if facts.torch else f"torch cannot be imported here ({facts.error})")
            return [
                f"cluster '{cluster.name}' runs {cluster.gpus_per_node} process(es) on CUDA GPUs, but {found}. "
                "Fix: launcher=plan to inspect the plan here, launcher=slurm or launcher=torchrun to emit the job "
                "for the GPU machines, or an experiment sized for this machine (+experiment=tiny_llama_cpu)."
            ]
    return []


def check_tracking(tracking, launcher) -> list[str]:
    """A tracked run needs MLflow where it runs: this process opens the run of a local
    launch or a sweep (found without importing it, which takes seconds)."""
    import importlib.util

    if not (tracking.enabled and launcher.name == "local"):
        return []
    if importlib.util.find_spec("mlflow") is None:
        return ["tracking is on, but MLflow is not installed here. Fix: tracking=off (the job directory keeps "
                "everything; `python -m gridwright.tracking.sync DIR` logs it later), or pip install mlflow==3.17.2."]
    from ..tracking.store import store_problem, tracking_uri

    problem = store_problem(tracking_uri(tracking))
    if problem and "Fix:" in problem:
        return [problem + "."]
    if problem:
        return [f"{problem}. Fix: tracking=off (the job directory keeps everything; `python -m "
                "gridwright.tracking.sync DIR` logs it later), or point tracking.uri (or MLFLOW_TRACKING_URI) at a "
                "store that works (move a damaged file aside)."]
    return []


def check_evaluate(evaluate, train, cluster) -> list[str]:
    """The profiling window must lie inside the run, and a named comm profile must exist."""
    out = []
    window = evaluate.profile_steps
    steps = train.steps
    if window is not None:
        if len(window) != 2 or not 0 <= window[0] < window[1] <= steps:
            out.append(
                f"evaluate.profile_steps={list(window)} must be [first, last) with "
                f"0 <= first < last <= train.steps={steps}. "
                f"Fix: evaluate.profile_steps=[{min(2, steps - 1)},{steps}] (after the first step, which includes warm-up)."
            )
    prof = cluster.comm_profile
    if prof is not None and not os.path.isfile(prof):
        out.append(
            f"cluster.comm_profile={prof} does not exist. Fix: cluster.comm_profile=null (no communication "
            "prediction), or measure one with "
            "`torchrun --nproc_per_node N -m gridwright.evaluations.bench_collectives --out FILE`."
        )
    return out
