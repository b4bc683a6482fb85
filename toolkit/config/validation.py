"""Every rule a composed experiment must pass before any process starts.

Each rule is a small function returning messages that name the offending values and a
fix. `validate` runs them all and raises one `ConfigError` listing every problem, so a
user fixes a broken layout in one round instead of one error at a time.
"""
from __future__ import annotations

import math
import os
import re

from omegaconf import OmegaConf

from ..families.hf_config import family_problems
from ..engines.registry import is_known, rules
from ..families.registry import FAMILIES
from ..planning.layout import ParallelLayout
from .schema import declared_choices
from ..planning.machine_probe import probe
from ..versions.megatron_version import refusal as megatron_core_refusal
from ..planning.placement import Placement, plan_placement
from ..planning.plan import CommProfileProblem, Plan, derive_plan, predict_communication

TORCHAO_FP8_RECIPES = ("tensorwise", "rowwise")  # gridwright.megatron_internals.parallel_linear
# The formats torchao's recipes fix (Float8LinearConfig.from_recipe_name)
TORCHAO_FP8_FORMATS = {"tensorwise": "hybrid", "rowwise": "e4m3"}
TORCHAO_FORMAT_WORDS = {"hybrid": "E4M3 forward and E5M2 for gradients", "e4m3": "E4M3 everywhere"}


class ConfigError(ValueError):
    """A composed experiment that cannot run; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            "the experiment is invalid; nothing was started:\n" + "\n".join(f"  - {p}" for p in problems)
        )


# Rules ----------------------------------------------------------------------
def check_choices(cfg) -> list[str]:
    """Every field whose choices the schema declares holds one of them (one pass over the
    schema), and the ranges of the few integer settings."""
    out = []
    for path, value, allowed, nullable in declared_choices(cfg):
        if value is None and nullable:
            continue
        if value not in allowed:
            out.append(f"{path}='{value}' is not one of {', '.join(allowed)}{' (or null)' if nullable else ''}.")
    if cfg.train.warmup_steps >= cfg.train.steps >= 1:
        out.append(
            f"train.warmup_steps={cfg.train.warmup_steps} must be below train.steps={cfg.train.steps} "
            "(the cosine decay needs steps after the warm-up)."
        )
    if cfg.zero.stage not in (0, 1, 2, 3):
        out.append(f"zero.stage={cfg.zero.stage} must be 0, 1, 2 or 3.")
    if cfg.launcher.max_restarts < 0:
        out.append(f"launcher.max_restarts={cfg.launcher.max_restarts} must be 0 or more.")
    return out


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
    file name an emitted script can quote."""
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
    return out


def check_model_split(model, train, layout: ParallelLayout) -> list[str]:
    m, out = model, []
    tp, pp = layout.tp, layout.pp
    if m.num_attention_heads % m.num_query_groups:
        out.append(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_query_groups={m.num_query_groups} (GQA needs whole query groups)."
        )
    if m.num_attention_heads % tp:
        out.append(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={tp}. "
            f"Fix: choose a TP among {_divisors(m.num_attention_heads)}."
        )
    if m.num_query_groups % tp:
        out.append(
            f"model.num_query_groups={m.num_query_groups} (key/value heads) is not divisible by "
            f"parallel.tp={tp}. Fix: choose a TP among {_divisors(m.num_query_groups)}."
        )
    if m.ffn_hidden_size % tp:
        out.append(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tp={tp}.")
    if m.family in FAMILIES:
        out += family_problems(dict(m))
    if m.vocab_size % tp:
        out.append(
            f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp} (Megatron-Core's "
            f"vocabulary-parallel embedding splits it evenly). Fix: choose a TP among {_divisors(m.vocab_size)[:8]}."
        )
    if m.num_layers % pp:
        out.append(
            f"model.num_layers={m.num_layers} is not divisible by parallel.pp={pp}. "
            f"Fix: choose a PP among {_divisors(m.num_layers)}."
        )
    elif layout.vpp and (m.num_layers // pp) % layout.vpp:
        out.append(
            f"model.num_layers={m.num_layers} over parallel.pp={pp} gives {m.num_layers // pp} layers "
            f"per stage, not divisible into parallel.vpp={layout.vpp} virtual stages. "
            f"Fix: choose a VPP among {_divisors(m.num_layers // pp)}."
        )
    if m.num_experts:
        if m.num_experts % layout.ep:
            out.append(
                f"model.num_experts={m.num_experts} is not divisible by parallel.ep={layout.ep}. "
                f"Fix: choose an EP among {_divisors(m.num_experts)}."
            )
        if tp > 1 and not layout.sp:
            out.append(
                f"an MoE model with parallel.tp={tp} needs parallel.sp=true (Megatron-Core refuses MoE with "
                "TP but without sequence parallelism)."
            )
        if m.moe_router_topk > m.num_experts:
            out.append(f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts={m.num_experts}.")
    elif layout.ep > 1 or layout.etp != layout.tp:
        out.append(
            f"parallel.ep={layout.ep} / parallel.etp={layout.etp} set for model '{m.name}', "
            "which has no experts. Fix: set parallel.ep=1 and parallel.etp=null, or pick an MoE model."
        )
    if train.seq_length > m.max_position_embeddings:
        out.append(
            f"train.seq_length={train.seq_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}."
        )
    return out


def check_context_parallel(train, layout: ParallelLayout) -> list[str]:
    s, cp = train.seq_length, layout.cp
    if cp > 1 and s % (2 * cp):
        return [
            f"train.seq_length={s} is not divisible by 2*parallel.cp={2 * cp} (context parallel "
            "splits each sequence into 2*CP chunks for load balance). "
            f"Fix: use a sequence length that is a multiple of {2 * cp}."
        ]
    return []


def check_batch(train, layout: ParallelLayout) -> list[str]:
    unit = train.micro_batch_size * layout.dp
    if train.global_batch_size % unit:
        return [
            f"train.global_batch_size={train.global_batch_size} is not micro-batch x accumulation x DP: "
            f"micro_batch_size={train.micro_batch_size} x DP={layout.dp} = {unit} does not divide it. "
            f"Fix: use a global batch that is a multiple of {unit}."
        ]
    return []


def fp8_backend(precision, te_available: bool):
    """Whose FP8 runs: "transformer_engine", "torchao", or None (no FP8). `auto` takes
    Transformer Engine where it imports, else torchao; rowwise exists only in torchao."""
    if precision.fp8_recipe is None:
        return None
    if precision.fp8_backend == "auto":
        return "transformer_engine" if te_available and precision.fp8_recipe != "rowwise" else "torchao"
    return precision.fp8_backend


def check_precision(cfg, for_launch: bool) -> list[str]:
    p, gpu, out = cfg.precision, cfg.cluster.gpu, []
    if p.fp8_recipe is None:
        if p.fp8_param:
            out.append("precision.fp8_param=true needs an FP8 recipe (precision.fp8_recipe).")
        return out
    if p.params_dtype == "fp32":
        out.append("FP8 training keeps bf16 weights: set precision.params_dtype=bf16.")
    torchao_asked = _torchao_asked(p)
    if torchao_asked:
        out += _torchao_fp8_problems(p, cfg.model, cfg.engine)
    if cfg.cluster.device != "cuda":
        if p.fp8_backend != "torchao":
            out.append(
                f"FP8 (precision.fp8_recipe={p.fp8_recipe}) needs CUDA GPUs; cluster '{cfg.cluster.name}' "
                "runs on cpu. Fix: precision=bf16, a GPU cluster, or precision.fp8_backend=torchao "
                "(FP8 arithmetic emulated, for tests)."
            )
    elif not torchao_asked and p.fp8_recipe not in gpu.fp8_recipes or torchao_asked and not gpu.fp8_recipes:
        supported = ", ".join(gpu.fp8_recipes) or "none"
        out.append(
            f"GPU kind {gpu.name} does not support FP8 recipe '{p.fp8_recipe}' (it supports: {supported}). "
            + ("MXFP8 needs Blackwell (B200/GB200). " if p.fp8_recipe == "mxfp8" else "")
            + "Fix: pick a supported recipe or precision=bf16."
        )
    if p.fp8_recipe == "blockwise" and p.fp8_format != "e4m3":
        out.append("precision.fp8_recipe=blockwise uses E4M3 everywhere: set precision.fp8_format=e4m3.")
    if for_launch and cfg.launcher.name == "local" and (cfg.cluster.device == "cuda" or p.fp8_backend == "torchao"):
        te = cfg.cluster.device == "cuda" and probe(transformer_engine=True).transformer_engine
        out += fp8_machine_problems(cfg, te)
    return out


def fp8_machine_problems(cfg, te_available: bool) -> list[str]:
    """What this machine lacks for the run's FP8: said before a local launch, and by every
    worker at start (a Slurm or torchrun job's nodes are seen only by its workers)."""
    p = cfg.precision
    # Transformer Engine counts only where its layer spec would be built
    te_available = te_available and rules(cfg.engine).builds_megatron_layer_spec(cfg.engine, cfg.parallel)
    backend = fp8_backend(p, te_available)
    if backend is None or backend == "transformer_engine" and te_available:
        return []
    torchao_asked = _torchao_asked(p)
    if backend == "transformer_engine":
        return [fp8_without_te(p.fp8_recipe)]
    if te_available:  # torchao asked for where TE imports: TE's layer spec would be built, without torchao
        return [f"precision.fp8_backend=torchao (or recipe {p.fp8_recipe}) runs inside the torch-native layer spec, "
                "but Transformer Engine imports here and its spec is used. Fix: precision.fp8_backend=transformer_engine "
                "or auto with a Transformer Engine recipe."]
    if not torchao_asked and p.fp8_recipe not in TORCHAO_FP8_RECIPES:
        return [fp8_without_te(p.fp8_recipe)]
    if not torchao_available():
        return [TORCHAO_MISSING]
    return [] if torchao_asked else _torchao_fp8_problems(p, cfg.model, cfg.engine)  # auto fell back to torchao: its rules apply now


def _torchao_asked(precision) -> bool:
    """torchao named by the config itself, not reached by `auto` falling back."""
    return precision.fp8_backend == "torchao" or precision.fp8_recipe == "rowwise"


def _torchao_fp8_problems(precision, model, engine) -> list[str]:
    p, out = precision, []
    if p.fp8_backend == "transformer_engine":
        out.append("precision.fp8_recipe=rowwise is torchao's: set precision.fp8_backend=torchao or auto.")
    elif p.fp8_recipe not in TORCHAO_FP8_RECIPES:
        out.append(f"precision.fp8_backend=torchao offers the recipes {', '.join(TORCHAO_FP8_RECIPES)}, "
                   f"not '{p.fp8_recipe}'.")
    if model.num_experts:
        out.append("FP8 through torchao covers dense layers only, not MoE experts: use Transformer Engine "
                   "or precision=bf16 for an MoE model.")
    if p.fp8_param:
        out.append("precision.fp8_param=true is Transformer Engine's (FP8 weights); torchao keeps bf16 weights.")
    wanted = TORCHAO_FP8_FORMATS.get(p.fp8_recipe)
    if wanted and p.fp8_format != wanted:
        out.append(f"torchao's {p.fp8_recipe} recipe uses {TORCHAO_FORMAT_WORDS[wanted]}: set precision.fp8_format={wanted}.")
    if engine.tp_comm_overlap:
        out.append("engine.tp_comm_overlap=true does not combine with FP8 through torchao yet "
                   "(the fused ops run bf16 matmuls): turn one off.")
    return out


def torchao_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def fp8_without_te(recipe: str) -> str:
    return (f"FP8 needs Transformer Engine for recipe '{recipe}' here (torchao runs only tensorwise and rowwise), "
            "and Transformer Engine cannot be imported. Megatron-Core would silently train in bf16 while the config "
            "says FP8, so gridwright refuses. Fix: install Transformer Engine (CUDA + cuDNN), "
            "precision=fp8_tensorwise or fp8_rowwise (torchao), or precision=bf16.")


TORCHAO_MISSING = "precision.fp8_backend=torchao needs torchao, which is not installed here: pip install torchao."


# Measured on 2 x H200 (evaluations/results/bench_gpu_20261127-1530.md): both compiled TP=2+SP
# runs through Megatron-Core's tensor-parallel linear function and its SP communication
# (linear_with_grad_accumulation_and_async_allreduce, the sequence-parallel mappings) did
# not learn: mean loss of the last 10 of 14 steps 10.48, where the uncompiled run had 8.88.
# On CPU the same run matches eager, so no CPU test can show it. With tp_comm_overlap the
# layers' TP matmuls and communication are gridwright's own autograd functions, and those
# runs learned (8.880 against 8.879).
COMPILED_MEGATRON_TP = (
    "engine.compile_layers=true with parallel.tp>1 would compile Megatron-Core's tensor-parallel linear function "
    "and its SP communication, and on GPU such a run did not learn (TP=2+SP: mean loss of the last 10 of 14 steps "
    "10.48 against 8.88 uncompiled; cause not found): add engine.tp_comm_overlap=true with parallel.sp=true "
    "(gridwright's own TP functions), or set compile_layers=false.")


def check_torch_native_paths(cfg, for_launch: bool = False) -> list[str]:
    e = cfg.engine
    if e.cuda_device_max_connections is not None and not 1 <= e.cuda_device_max_connections <= 32:
        return [f"engine.cuda_device_max_connections={e.cuda_device_max_connections} must be 1 to 32 (or null)."]
    if not (is_known(e) and rules(e).CAPABILITIES.megatron_torch_native_paths):
        return []  # the engine's own rules say what it compiles
    if e.tp_comm_overlap and not (cfg.parallel.sp and cfg.parallel.tp > 1):
        return ["engine.tp_comm_overlap=true overlaps sequence parallelism's communication: it needs "
                "parallel.tp>1 and parallel.sp=true."]
    keys = _torch_native_keys_on(e)
    if e.compile_layers and cfg.parallel.tp > 1 and not e.tp_comm_overlap:
        return [COMPILED_MEGATRON_TP]
    if keys and for_launch and cfg.launcher.name == "local" and cfg.cluster.device == "cuda":
        return torch_native_machine_problems(e, cfg.parallel, probe(transformer_engine=True).transformer_engine)
    return []


def _torch_native_keys_on(engine) -> list[str]:
    return [k for k in ("tp_comm_overlap", "compile_layers") if getattr(engine, k)]


def torch_native_machine_problems(engine, parallel, te_available: bool) -> list[str]:
    """The torch-native paths asked for where Transformer Engine imports (its spec is then
    used): said before a local launch, and by every worker at start."""
    keys = _torch_native_keys_on(engine)
    if not (te_available and keys and rules(engine).builds_megatron_layer_spec(engine, parallel)):
        return []
    return [f"{', '.join(f'engine.{k}=true' for k in keys)} applies to the torch-native layer spec; Transformer "
            "Engine imports here, so its spec is used, which gridwright does not compile or overlap: turn it off."]


def check_megatron_core(launcher, for_launch: bool) -> list[str]:
    """The installed Megatron-Core must be the tested release (a local launch runs on this
    machine; other launchers' workers check their own at import of megatron_internals)."""
    if not (for_launch and launcher.name == "local"):
        return []
    problem = megatron_core_refusal()
    return [problem] if problem else []


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


def check_data(data, model, launcher) -> list[str]:
    from ..data.prepare_data import dataset_info

    d, out = data, []
    if d.kind not in ("synthetic", "indexed"):
        return [f"data.kind='{d.kind}' is not one of synthetic, indexed."]
    if d.eval_interval < 0 or d.eval_iters < 1:
        out.append(f"data.eval_interval={d.eval_interval} must be >= 0 and data.eval_iters={d.eval_iters} >= 1.")
    if d.kind == "synthetic":
        return out
    if not d.paths:
        return out + ["data.kind=indexed needs data.paths (prefixes made by gridwright.data.prepare_data)."]
    if d.weights is not None and len(d.weights) != len(d.paths):
        out.append(f"data.weights has {len(d.weights)} entries for {len(d.paths)} data.paths.")
    if launcher.name != "local":
        return out  # the files live on the cluster
    tokenizers = set()
    for prefix in d.paths:
        missing = [prefix + s for s in (".bin", ".idx") if not os.path.exists(prefix + s)]
        if missing:
            out.append(f"dataset files missing: {', '.join(missing)}. Fix: run gridwright.data.prepare_data first.")
            continue
        try:
            info = dataset_info(prefix)
        except (OSError, ValueError) as e:
            out.append(str(e))
            continue
        tokenizers.add(info["tokenizer"])
        out += _split_problems(prefix, info["documents"], d.split)
        if info["vocab_size"] > model.vocab_size:
            out.append(
                f"{prefix} was tokenized with a vocabulary of {info['vocab_size']} ({info['tokenizer']}), larger "
                f"than model.vocab_size={model.vocab_size}. Fix: model.vocab_size>={info['vocab_size']}."
            )
    if len(tokenizers) > 1:
        out.append(f"data.paths were made with different tokenizers: {sorted(tokenizers)}.")
    return out


def _split_problems(prefix: str, documents: int, split: str) -> list[str]:
    """Each split with a nonzero share needs a document (Megatron-Core loops forever on an empty one)."""
    try:
        shares = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        return [f"data.split='{split}' must be comma-separated numbers, e.g. 98,2,0."]
    total = sum(shares)
    names = ("train", "validation", "test")
    return [
        f"{prefix} has {documents} documents: the {names[i]} share {share:g}/{total:g} of data.split='{split}' "
        "gets none. Fix: more documents, or a share of 0 for that split."
        for i, share in enumerate(shares[:3])
        if share > 0 and documents * share / total < 1
    ]


def check_checkpoint(cfg) -> list[str]:
    from pathlib import Path

    from ..checkpoints.checkpoint_dir import LATEST, writer_problem

    ck, out = cfg.checkpoint, []
    if ck.keep_last < 0:
        out.append(f"checkpoint.keep_last={ck.keep_last} must be 0 (keep every checkpoint) or positive.")
    if not (ck.save or ck.load):
        return out
    if ck.save_interval < 0:
        out.append(f"checkpoint.save_interval={ck.save_interval} must be 0 (end only) or positive.")
    if is_known(cfg.engine):
        out += rules(cfg.engine).checkpoint_problems(cfg)
    for root in {ck.save, ck.load} - {None}:
        problem = writer_problem(root) if cfg.launcher.name == "local" else None
        if problem:
            out.append(problem)
    if ck.save and cfg.launcher.name == "local":
        from ..atomic_io import unwritable_reason
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
                "mix runs. Fix: resume with checkpoint.load set to the same directory, or save elsewhere."
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
                "Fix: a CPU cluster (cluster=laptop), a cluster that fits this machine, or launcher=plan, "
                "torchrun or slurm to plan or emit the job for a GPU machine."
            ]
    return []


def check_tracking(tracking, launcher) -> list[str]:
    """A tracked run needs MLflow where it runs: this process opens the run of a local
    launch or a sweep (found without importing it, which takes seconds)."""
    import importlib.util

    if not (tracking.enabled and launcher.name == "local"):
        return []
    if importlib.util.find_spec("mlflow") is None:
        return ["tracking is on, but MLflow is not installed here. Fix: pip install mlflow==3.17.2, or "
                "tracking=off (the job directory keeps everything; `python -m gridwright.tracking.sync DIR` logs it later)."]
    from ..tracking.store import store_problem, tracking_uri

    problem = store_problem(tracking_uri(tracking))
    if problem:
        return [f"{problem}. Fix: point tracking.uri (or MLFLOW_TRACKING_URI) at a store that works (move a "
                "damaged file aside), or tracking=off (the job directory keeps everything; `python -m gridwright.tracking.sync DIR` logs "
                "it later)."]
    return []


def check_nvlink_domains(parallel, model, placement: Placement) -> list[str]:
    out, d = [], placement.layout.nvlink_domain_size
    for kind, allow, flag in (
        ("tp", parallel.allow_tp_across_nvlink, "parallel.allow_tp_across_nvlink"),
        ("etp_ep", parallel.allow_ep_across_nvlink, "parallel.allow_ep_across_nvlink"),
    ):
        if allow or (kind == "etp_ep" and not model.num_experts):
            continue
        crossing = placement.groups_crossing_domain(kind, d)
        if crossing:
            what = "tensor-parallel" if kind == "tp" else "expert-parallel (expert-TP x EP)"
            out.append(
                f"{len(crossing)} {what} group(s) span NVLink domains of {d} GPUs, e.g. ranks "
                f"{crossing[0]}: their all-reduce / all-to-all would cross the network. "
                f"Fix: make the group fit in {d} GPUs, or set {flag}=true."
            )
    return out


def check_host_memory(model, cluster, launcher, plan: Plan) -> list[str]:
    """A CPU run launched here keeps its weights, gradients and Adam's state in this
    machine's memory (16 bytes a parameter in fp32, split over TP and PP): refuse a model
    the machine cannot hold, before its processes allocate their way into the OOM killer."""
    if cluster.device != "cpu" or launcher.name != "local":
        return []
    import psutil

    params, layout = plan.params.total, plan.layout
    need = params / (layout.tp * layout.pp) * 16 * cluster.gpus_per_node
    have = psutil.virtual_memory().total
    if need <= have:
        return []
    return [f"model {model.name} has {params / 1e9:.3g} B parameters: its {cluster.gpus_per_node} CPU "
            f"processes need about {need / 2**30:,.0f} GiB for weights, gradients and Adam's state, and this machine "
            f"has {have / 2**30:,.0f} GiB. Fix: a smaller model, or launcher=plan, torchrun or slurm to plan or emit "
            "the job for machines that hold it."]


def check_memory(gpu, plan: Plan) -> list[str]:
    """The plan's per-GPU estimate (GPU clusters only) against the GPU's memory."""
    est, cap = plan.memory, gpu.memory_gib
    if est is None or cap <= 0:
        return []
    if est.total_gib > cap:
        return [
            f"estimated memory per GPU {est.describe()} exceeds {gpu.name}'s {cap:.1f} GiB. "
            "Fix: train.recompute=full, a higher ZeRO stage, more TP/PP/EP, or a smaller micro-batch."
        ]
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
                f"0 <= first < last <= train.steps={steps}, e.g. [{min(2, steps - 1)}, {steps}]. "
                "Fix: pick steps after the first (it includes warm-up)."
            )
    prof = cluster.comm_profile
    if prof is not None and not os.path.isfile(prof):
        out.append(
            f"cluster.comm_profile={prof} does not exist. Fix: measure one with "
            "`torchrun --nproc_per_node N -m gridwright.evaluations.bench_collectives --out FILE`, "
            "or set cluster.comm_profile=null."
        )
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg, for_launch: bool = True) -> Plan:
    """Check everything; return the plan (derived once, here), or raise ConfigError."""
    count_problems = check_counts(cfg.model, cfg.train, cfg.cluster)
    problems = check_choices(cfg) + count_problems + check_numbers(cfg) + check_paths(cfg)
    layout = ParallelLayout.from_config(cfg)
    counts_ok = not count_problems  # else the layout's arithmetic would divide by zero
    layout_problems = layout.problems() if counts_ok else []
    problems += layout_problems
    if counts_ok and not layout_problems:
        problems += check_model_split(cfg.model, cfg.train, layout)
        problems += check_context_parallel(cfg.train, layout)
        problems += check_batch(cfg.train, layout)
        problems += check_engine(cfg, layout, for_launch)
    problems += check_precision(cfg, for_launch)
    problems += check_torch_native_paths(cfg, for_launch)
    problems += check_launcher(cfg.launcher, cfg.cluster, for_launch)
    problems += check_megatron_core(cfg.launcher, for_launch)
    problems += check_tracking(cfg.tracking, cfg.launcher)
    problems += check_checkpoint(cfg)
    problems += check_data(cfg.data, cfg.model, cfg.launcher)
    problems += check_evaluate(cfg.evaluate, cfg.train, cfg.cluster)
    plan = None
    if not problems:
        placement = plan_placement(layout)
        problems += check_nvlink_domains(cfg.parallel, cfg.model, placement)
        try:
            plan = derive_plan(cfg, layout, placement)
        except CommProfileProblem as e:
            problems.append(str(e))
    if plan is not None:
        problems += check_memory(cfg.cluster.gpu, plan)
        problems += check_host_memory(cfg.model, cfg.cluster, cfg.launcher, plan)
    elif counts_ok and not layout_problems and os.path.isfile(cfg.cluster.comm_profile or ""):
        try:  # no plan for an invalid config, but a profile that cannot price it is one more fix to list
            predict_communication(cfg, layout)
        except CommProfileProblem as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(problems)
    return plan
