"""Every rule a composed experiment must pass before any process starts.

Each rule is a small function returning messages that name the offending values and a
fix. `validate` runs them all and raises one `ConfigError` listing every problem, so a
user fixes a broken layout in one round instead of one error at a time.
"""
from __future__ import annotations

import difflib
import itertools
import math
import os
import re
from contextlib import contextmanager
from dataclasses import replace

from omegaconf import OmegaConf

from ..families.hf_config import family_problems, fitting_family
from ..engines.registry import is_known, rules
from ..data.packing import longest_document
from ..families.registry import FAMILIES
from ..planning.layout import ParallelLayout, max_seqlen_per_rank
from .fp8_choice import TORCHAO_FP8_RECIPES, fp8_backend, torch_native_asked, transformer_engine_layers
from .schema import declared_choices
from ..planning.machine_probe import host_memory_bytes, probe
from ..planning.memory_estimate import GIB, estimate_memory, host_memory_estimate
from ..versions.megatron_version import refusal as megatron_core_refusal
from ..versions.torch_version import refusal as torch_refusal
from ..planning.placement import Placement, plan_placement
from ..planning.plan import CommProfileProblem, Plan, derive_plan, predict_communication

# The formats torchao's recipes fix (Float8LinearConfig.from_recipe_name)
TORCHAO_FP8_FORMATS = {"tensorwise": "hybrid", "rowwise": "e4m3"}
TORCHAO_FORMAT_WORDS = {"hybrid": "E4M3 forward and E5M2 for gradients", "e4m3": "E4M3 everywhere"}
# The precision preset (conf/precision/) of each FP8 recipe
FP8_PRESETS = {"delayed": "fp8_delayed", "tensorwise": "fp8_tensorwise", "rowwise": "fp8_rowwise",
               "blockwise": "fp8_blockwise", "mxfp8": "mxfp8"}


class ConfigError(ValueError):
    """A composed experiment that cannot run; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            "the experiment is invalid; nothing was started:\n" + "\n".join(f"  - {p}" for p in problems)
        )


# Fixes ----------------------------------------------------------------------
# A problem's advice follows "Fix: ". Its first suggestion is either a run of Hydra
# overrides (`key=value` words, ended by punctuation or by the first other word), which
# `fix_overrides` reads and a user or a tool adds to the command line, or, where no
# override helps, an action in words ("rm ... && python -m ..."). Where the override is
# computed (a divisor, a layout, a memory saving) it was tried on the config first: it
# answers the problem, passes the layout rules, and never repeats a value already set.
OVERRIDE_WORD = re.compile(r"[+~]?[A-Za-z_][\w.]*=\S+")


def fix_overrides(problem: str) -> list[str] | None:
    """The first suggestion of `problem`'s Fix as overrides; None where it is an action in words."""
    if "Fix: " not in problem:
        return None
    out = []
    for word in problem.split("Fix: ", 1)[1].split():
        bare = word.rstrip(",;.")
        if not OVERRIDE_WORD.fullmatch(bare):
            break
        out.append(bare)
        if bare != word:  # punctuation ends the suggestion
            break
    return out or None


def _words(overrides: dict) -> str:
    """Overrides as command-line words: `parallel.tp=4 parallel.sp=true`."""
    def value(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return " ".join(f"{k}={value(v)}" for k, v in overrides.items())


def _fix(found: dict | None, otherwise: str) -> str:
    """The Fix: the overrides found, or the advice in words where none were found."""
    return f"Fix: {_words(found)}" if found else f"Fix: {otherwise}"


def _near(current: int, options) -> list[int]:
    """`options` other than `current`, nearest first: the smaller ones downwards, then the larger."""
    return sorted((o for o in options if o < current), reverse=True) + sorted(o for o in options if o > current)


def _layout_passes(model, train, layout: ParallelLayout) -> bool:
    """Whether a candidate layout passes every rule that depends on it: a degree or batch
    offered as a fix is tried against these first."""
    return not (layout.problems() or _division_problems(model, train, layout, advise=False)
                or check_context_parallel(train, layout, model) or check_batch(train, layout))


def _first_passing(model, train, candidates) -> dict | None:
    """The overrides of the first (overrides, layout) candidate whose layout passes."""
    return next((overrides for overrides, layout in candidates if _layout_passes(model, train, layout)), None)


@contextmanager
def _tried(cfg, overrides: dict):
    """`cfg` as a fix would leave it: the dotted `overrides` applied in place, and undone on
    leaving (a fix search tries dozens; copying the config costs more than checking it)."""
    before = {key: OmegaConf.select(cfg, key) for key in overrides}
    try:
        for key, value in overrides.items():
            OmegaConf.update(cfg, key, value, merge=False)
        yield cfg
    finally:
        for key, value in before.items():
            OmegaConf.update(cfg, key, value, merge=False)


# Rules ----------------------------------------------------------------------
def check_choices(cfg) -> list[str]:
    """Every field whose choices the schema declares holds one of them (one pass over the
    schema), and the ranges of the few integer settings."""
    out = []
    for path, value, allowed, nullable in declared_choices(cfg):
        if value is None and nullable:
            continue
        if value not in allowed:
            # one the value begins, else the nearest spelling; a family by the model's shape
            # (its experts and fixed values)
            near = fitting_family(dict(cfg.model)) if path == "model.family" else next(
                (a for a in allowed if a.startswith(str(value))),
                (difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.0) or [allowed[0]])[0])
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
    from ..path_rules import system_place

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


def check_model_split(model, train, layout: ParallelLayout, world_fix: str | None = None) -> list[str]:
    """The model's own shape, and how the layout splits it. `world_fix`: the world-size
    problem's Fix, which answers these too (it passes every rule), where the grid is broken."""
    m, out = model, []
    if m.num_attention_heads % m.num_query_groups:
        out.append(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_query_groups={m.num_query_groups} (GQA needs whole query groups)."
        )
    if m.family in FAMILIES:
        out += family_problems(dict(m))
    if m.num_experts and m.moe_router_topk > m.num_experts:
        out.append(f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts={m.num_experts}. "
                   f"Fix: model.moe_router_topk={m.num_experts}.")
    if train.seq_length > m.max_position_embeddings:
        out.append(
            f"train.seq_length={train.seq_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}. Fix: train.seq_length={m.max_position_embeddings}."
        )
    return out + _division_problems(model, train, layout, world_fix=world_fix)


# What tensor parallelism splits, where the name does not say it
TP_SPLITS = {"model.num_query_groups": " (the key/value heads are split)",
             "model.vocab_size": " (Megatron-Core's vocabulary-parallel embedding splits it evenly)"}


def _division_problems(model, train, layout: ParallelLayout, advise: bool = True,
                       world_fix: str | None = None) -> list[str]:
    """How the layout's degrees divide the model. With `advise`, each problem's Fix is a
    degree tried against every layout rule (without, the rules only answer yes or no), or
    `world_fix` where one was found for a broken grid."""
    m, out = model, []
    tp, pp = layout.tp, layout.pp

    def fix(candidates, otherwise: str) -> str:
        if advise and world_fix:
            return f"Fix: {world_fix}"
        return _fix(_first_passing(m, train, candidates) if advise else None, otherwise)

    tp_fix = ""
    for size, path in ((m.num_attention_heads, "model.num_attention_heads"), (m.num_query_groups, "model.num_query_groups"),
                       (m.ffn_hidden_size, "model.ffn_hidden_size"), (m.vocab_size, "model.vocab_size")):
        if size % tp:
            tp_fix = tp_fix or fix(_tp_candidates(m, layout), f"choose a TP that divides {path}={size}.")
            out.append(f"{path}={size} is not divisible by parallel.tp={tp}{TP_SPLITS.get(path, '')}. {tp_fix}")
    if m.num_layers % pp:
        pp_candidates = [({"parallel.pp": d} | ({"parallel.vpp": None} if vpp != layout.vpp else {}),
                          replace(layout, pp=d, vpp=vpp))
                         for d in _near(pp, _divisors(m.num_layers))
                         for vpp in dict.fromkeys((layout.vpp if d > 1 else None, None))]
        out.append(
            f"model.num_layers={m.num_layers} is not divisible by parallel.pp={pp}. "
            + fix(pp_candidates, f"choose a PP among {_divisors(m.num_layers)}.")
        )
    elif layout.vpp and (m.num_layers // pp) % layout.vpp:
        per_stage = m.num_layers // pp
        vpp_candidates = [({"parallel.vpp": v}, replace(layout, vpp=v))
                          for v in _near(layout.vpp, _divisors(per_stage)) if v > 1] + [
                         ({"parallel.vpp": None}, replace(layout, vpp=None))]
        out.append(
            f"model.num_layers={m.num_layers} over parallel.pp={pp} gives {per_stage} layers "
            f"per stage, not divisible into parallel.vpp={layout.vpp} virtual stages. "
            + fix(vpp_candidates, f"choose a VPP among {_divisors(per_stage)}.")
        )
    if m.num_experts:
        if m.num_experts % layout.ep:
            ep_candidates = [({"parallel.ep": d}, replace(layout, ep=d)) for d in _near(layout.ep, _divisors(m.num_experts))]
            out.append(
                f"model.num_experts={m.num_experts} is not divisible by parallel.ep={layout.ep}. "
                + fix(ep_candidates, f"choose an EP among {_divisors(m.num_experts)}.")
            )
        if tp > 1 and not layout.sp:
            out.append(
                f"an MoE model with parallel.tp={tp} needs parallel.sp=true (Megatron-Core refuses MoE with "
                "TP but without sequence parallelism). Fix: parallel.sp=true."
            )
    elif layout.ep > 1 or layout.etp != layout.tp:
        dense = ({"parallel.ep": 1} if layout.ep > 1 else {}) | ({"parallel.etp": None} if layout.etp != layout.tp else {})
        out.append(
            f"parallel.ep={layout.ep} / parallel.etp={layout.etp} set for model '{m.name}', "
            f"which has no experts. Fix: {_words(dense)}, or pick an MoE model."
        )
    return out


def _tp_candidates(model, layout: ParallelLayout, cap: int | None = None) -> list[tuple[dict, ParallelLayout]]:
    """Other TPs that divide the attention heads, nearest first (at most `cap`), each with
    the sequence parallelism it needs: on for an MoE model, off at TP=1."""
    out = []
    for d in _near(layout.tp, _divisors(model.num_attention_heads)):
        if cap and d > cap:
            continue
        sp = (layout.sp or bool(model.num_experts)) if d > 1 else False
        etp = d if layout.etp == layout.tp else layout.etp  # a null expert TP follows TP
        overrides = {"parallel.tp": d} | ({"parallel.sp": sp} if sp != layout.sp else {})
        out.append((overrides, replace(layout, tp=d, sp=sp, etp=etp)))
    return out


def check_context_parallel(train, layout: ParallelLayout, model) -> list[str]:
    s, unit = train.seq_length, 2 * layout.cp
    if layout.cp > 1 and s % unit:
        up, down = -(-s // unit) * unit, s // unit * unit
        fitting = up if up <= model.max_position_embeddings or down == 0 else down
        return [
            f"train.seq_length={s} is not divisible by 2*parallel.cp={unit} (context parallel "
            "splits each sequence into 2*CP chunks for load balance). "
            f"Fix: train.seq_length={fitting} (a multiple of {unit})."
        ]
    return []


def check_cp_comm_type(parallel, data, model, layout: ParallelLayout) -> list[str]:
    """The all-to-all form (parallel.cp_comm_type=a2a) gives each CP rank 1/CP of this TP
    rank's heads and key/value groups for the whole sequence, so both must divide by CP."""
    if parallel.cp_comm_type != "a2a":
        return []
    if layout.cp == 1:
        return ["parallel.cp_comm_type=a2a is read only by static context parallelism (parallel.cp > 1). "
                "Fix: parallel.cp_comm_type=all_gather."]
    if data.packing:
        return ["parallel.cp_comm_type=a2a with data.packing: packed documents are built for the all-gather form "
                "only. Fix: parallel.cp_comm_type=all_gather."]
    heads = model.num_attention_heads // layout.tp
    groups = (model.num_query_groups or model.num_attention_heads) // layout.tp
    if groups == 0 or heads % layout.cp or groups % layout.cp:
        shared = math.gcd(heads, max(groups, 1))
        other = f", or a parallel.cp that divides {shared}" if shared > 1 else ""
        return [f"parallel.cp_comm_type=a2a with parallel.cp={layout.cp}: each rank of TP={layout.tp} holds "
                f"{heads} heads and {max(groups, 1)} key/value groups of model={model.name}, and the all-to-all "
                f"form gives each CP rank an equal share of both. Fix: parallel.cp_comm_type=all_gather{other}."]
    return []


def check_packing(data, parallel, train, model, layout: ParallelLayout) -> list[str]:
    """Packed documents (data.packing) and dynamic context parallelism (parallel.cp_mode):
    what gridwright's packed path and Megatron-Core 0.16.1's hybrid groups support."""
    out, dynamic = [], parallel.cp_mode == "dynamic"
    if dynamic and not data.packing:
        out.append("parallel.cp_mode=dynamic deals whole documents to the DP ranks: it needs packed data. "
                   "Fix: data.packing=true.")
    if parallel.cp_scheduler != "megatron" and not dynamic:
        out.append(f"parallel.cp_scheduler={parallel.cp_scheduler} is read only by parallel.cp_mode=dynamic. "
                   "Fix: parallel.cp_mode=dynamic.")
    if not data.packing:
        if parallel.max_seqlen_per_rank is not None:
            out.append(f"parallel.max_seqlen_per_rank={parallel.max_seqlen_per_rank} is read only by "
                       "parallel.cp_mode=dynamic. Fix: parallel.max_seqlen_per_rank=null.")
        return out
    lengths = data.doc_lengths
    if lengths.min < 1 or lengths.median < 1 or lengths.sigma < 0 or (lengths.cap is not None and lengths.cap < lengths.min):
        out.append(f"data.doc_lengths (median {lengths.median}, sigma {lengths.sigma}, min {lengths.min}, cap "
                   f"{lengths.cap}) must have median >= 1, sigma >= 0 and 1 <= min <= cap.")
    if layout.pp > 1:
        out.append(f"data.packing with parallel.pp={layout.pp}: the pipeline schedule sends activations of one "
                   "fixed shape between stages, and packed micro-batches vary in length (not built). "
                   f"Fix: parallel.pp=1{' parallel.vpp=null' if layout.vpp else ''}.")
    if model.num_experts:
        out.append(f"data.packing with model={model.name} (MoE): packed documents are built for dense models only. "
                   "Fix: data.packing=false.")
    if parallel.max_seqlen_per_rank is not None and not dynamic:
        out.append(f"parallel.max_seqlen_per_rank={parallel.max_seqlen_per_rank} is read only by "
                   "parallel.cp_mode=dynamic. Fix: parallel.cp_mode=dynamic.")
    if not dynamic:
        return out
    if layout.cp > 1:
        out.append(f"parallel.cp_mode=dynamic with parallel.cp={layout.cp}: dynamic context parallelism draws each "
                   "document's CP group from the DP ranks, which a static CP would split. "
                   f"Fix: parallel.cp=1 (DP becomes {layout.dp * layout.cp}).")
    if layout.tp > 1:
        out.append(f"parallel.cp_mode=dynamic with parallel.tp={layout.tp}: not built (each TP rank would have to "
                   "see the same documents in the same order; untested). Fix: parallel.tp=1.")
    ranks = layout.dp * layout.cp
    if ranks & (ranks - 1):
        out.append(f"parallel.cp_mode=dynamic needs a power-of-two number of DP ranks (Megatron-Core builds its "
                   f"hybrid CP groups of 2, 4, 8 ... ranks: parallel_state.create_hybrid_dp_cp_groups); DP is "
                   f"{ranks}. Fix: parallel.cp_mode=static, or a world size whose DP is a power of two.")
    longest = longest_document(lengths, train.seq_length)
    per_rank = max_seqlen_per_rank(parallel, train.seq_length)
    if per_rank < 1:
        out.append(f"parallel.max_seqlen_per_rank={per_rank} must be at least 1. Fix: parallel.max_seqlen_per_rank=null.")
    elif longest > per_rank * ranks:
        out.append(f"A document of up to {longest} tokens (data.doc_lengths.cap, or train.seq_length) does not fit "
                   f"parallel.max_seqlen_per_rank={per_rank} x {ranks} DP ranks = {per_rank * ranks}: no CP group "
                   f"could hold it. Fix: parallel.max_seqlen_per_rank={-(-longest // ranks)}.")
    return out


def check_batch(train, layout: ParallelLayout) -> list[str]:
    unit = train.micro_batch_size * layout.dp
    if train.global_batch_size % unit:
        return [
            f"train.global_batch_size={train.global_batch_size} is not micro-batch x accumulation x DP: "
            f"micro_batch_size={train.micro_batch_size} x DP={layout.dp} = {unit} does not divide it. "
            f"Fix: train.global_batch_size={-(-train.global_batch_size // unit) * unit} (a multiple of {unit})."
        ]
    return []


def check_precision(cfg, for_launch: bool) -> list[str]:
    p, gpu, out = cfg.precision, cfg.cluster.gpu, []
    if p.fp8_recipe is None:
        if p.fp8_param:
            out.append("precision.fp8_param=true needs an FP8 recipe (precision.fp8_recipe).")
        if p.fp8_output_layer:
            out.append("precision.fp8_output_layer=true needs an FP8 recipe: use precision=fp8_tensorwise "
                       "(or fp8_rowwise).")
        return out
    if p.params_dtype == "fp32":
        out.append("FP8 training keeps bf16 weights: set precision.params_dtype=bf16.")
    torchao_asked = _torchao_asked(p)
    if torchao_asked:
        out += _torchao_fp8_problems(p, cfg.model, cfg.engine)
    if p.fp8_output_layer:
        out += _fp8_output_layer_problems(p, cfg.model, cfg.parallel.tp)
    if cfg.cluster.device != "cuda":
        if p.fp8_backend != "torchao":
            out.append(
                f"FP8 (precision.fp8_recipe={p.fp8_recipe}) needs CUDA GPUs; cluster '{cfg.cluster.name}' "
                f"runs on cpu. Fix: {_words(_to_recipe(p, None))} (bf16 without FP8), a GPU cluster, or "
                "precision.fp8_backend=torchao (FP8 arithmetic emulated, for tests)."
            )
    elif not torchao_asked and p.fp8_recipe not in gpu.fp8_recipes or torchao_asked and not gpu.fp8_recipes:
        supported = ", ".join(gpu.fp8_recipes) or "none"
        other = None if torchao_asked else next((r for r in gpu.fp8_recipes if r in FP8_PRESETS), None)
        out.append(
            f"GPU kind {gpu.name} does not support FP8 recipe '{p.fp8_recipe}' (it supports: {supported}). "
            + ("MXFP8 needs Blackwell (B200/GB200). " if p.fp8_recipe == "mxfp8" else "")
            + f"Fix: {_words(_to_recipe(p, other))}"
            + (f" (a supported recipe), or {_words(_to_recipe(p, None))}." if other else " (bf16 without FP8).")
        )
    if p.fp8_recipe == "blockwise" and p.fp8_format != "e4m3":
        out.append("precision.fp8_recipe=blockwise uses E4M3 everywhere: set precision.fp8_format=e4m3.")
    if for_launch and cfg.launcher.name == "local" and (cfg.cluster.device == "cuda" or p.fp8_backend == "torchao"):
        te = cfg.cluster.device == "cuda" and probe(transformer_engine=True).transformer_engine
        out += fp8_machine_problems(cfg, te)
    return out


def _to_recipe(precision, recipe: str | None) -> dict:
    """The overrides that make `precision` run `recipe` (None: bf16 without FP8): its preset
    where the current recipe came from one, else the key itself (an override of the key
    would outlive a change of preset)."""
    p = precision
    from_preset = p.name == FP8_PRESETS.get(p.fp8_recipe)
    if recipe is None:
        return {"precision": "bf16"} if from_preset else {"precision.fp8_recipe": None}
    return {"precision": FP8_PRESETS[recipe]} if from_preset else {"precision.fp8_recipe": recipe}


def fp8_machine_problems(cfg, te_imports: bool) -> list[str]:
    """What this machine lacks for the run's FP8: said before a local launch, and by every
    worker at start (a Slurm or torchrun job's nodes are seen only by its workers)."""
    p = cfg.precision
    builds_spec = rules(cfg.engine).builds_megatron_layer_spec(cfg.engine, cfg.parallel)
    te_layers = builds_spec and transformer_engine_layers(cfg.engine, p, te_imports)
    backend = fp8_backend(p, te_layers)
    if backend is None:
        return []
    if backend == "transformer_engine" and te_layers:  # TE's layers; the float8 output layer is torchao's
        return [TORCHAO_MISSING] if p.fp8_output_layer and not torchao_available() else []
    torchao_asked = _torchao_asked(p)
    te_recipe = p.fp8_backend == "transformer_engine" or p.fp8_recipe not in TORCHAO_FP8_RECIPES
    if te_recipe and te_imports and builds_spec:  # TE is here, but the run builds the torch-native spec
        return [_te_fp8_on_torch_native(cfg.engine, p)]
    if backend == "transformer_engine":
        return [fp8_without_te(p)]
    if te_layers:  # torchao asked for where engine.layer_spec=transformer_engine builds TE's layers
        return [f"precision.fp8_backend=torchao (or recipe {p.fp8_recipe}) runs inside the torch-native layer spec, "
                "but engine.layer_spec=transformer_engine builds Transformer Engine's. Fix: engine.layer_spec=auto."]
    if not torchao_asked and p.fp8_recipe not in TORCHAO_FP8_RECIPES:
        return [fp8_without_te(p)]
    if not torchao_available():
        return [TORCHAO_MISSING]
    return [] if torchao_asked else _torchao_fp8_problems(p, cfg.model, cfg.engine)  # auto fell back to torchao: its rules apply now


def _te_fp8_on_torch_native(engine, precision) -> str:
    """A Transformer Engine recipe in a run whose keys choose the torch-native spec."""
    if engine.layer_spec == "torch_native":
        why, fix = "engine.layer_spec=torch_native", "engine.layer_spec=auto"
    else:
        keys = torch_native_asked(engine, precision)
        why = f"{', '.join(keys)} {'asks' if len(keys) == 1 else 'ask'} for the torch-native spec"
        fix = _turned_off(keys)
    return (f"precision.fp8_recipe={precision.fp8_recipe} is Transformer Engine's, but this run builds the "
            f"torch-native layer spec ({why}). Fix: {fix}.")


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


def _fp8_output_layer_problems(precision, model, tp: int) -> list[str]:
    """The output layer in float8 (torchao's tensorwise matmul under either FP8 backend:
    choose_torch_native_paths says why): its vocabulary shard a multiple of 16, which float8
    GEMMs need of every dimension."""
    shard = model.vocab_size // tp
    if model.vocab_size % tp or shard % 16:
        return [f"precision.fp8_output_layer=true: each rank's vocabulary shard ({model.vocab_size} / TP {tp}) "
                "must be a multiple of 16 for float8 GEMMs. Use precision.fp8_output_layer=false."]
    return []


def torchao_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def fp8_without_te(precision) -> str:
    """FP8 asked of Transformer Engine where it does not import; the first fix runs FP8 through torchao."""
    p = precision
    if p.fp8_recipe in TORCHAO_FP8_RECIPES:  # Transformer Engine named explicitly
        torchao = {"precision.fp8_backend": "torchao"}
    else:
        torchao = _to_recipe(p, "tensorwise")
        if "precision.fp8_recipe" in torchao and p.fp8_format != TORCHAO_FP8_FORMATS["tensorwise"]:
            torchao["precision.fp8_format"] = TORCHAO_FP8_FORMATS["tensorwise"]
        if p.fp8_backend == "transformer_engine":
            torchao["precision.fp8_backend"] = "auto"
    return (f"FP8 needs Transformer Engine for recipe '{p.fp8_recipe}' here (torchao runs only tensorwise and "
            "rowwise), and Transformer Engine cannot be imported. Megatron-Core would silently train in bf16 while "
            f"the config says FP8, so gridwright refuses. Fix: {_words(torchao)} (FP8 through torchao), "
            f"{_words(_to_recipe(p, None))}, or install Transformer Engine (CUDA + cuDNN).")


TORCHAO_MISSING = "precision.fp8_backend=torchao needs torchao, which is not installed here: pip install torchao."


# Measured on 2 x H200 (bench_gpu_20261127-1530.md, evaluations/results at 8871d16): both compiled TP=2+SP
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
    if e.attention_backend in ("cudnn", "efficient") and cfg.cluster.device != "cuda":
        return [f"engine.attention_backend={e.attention_backend} is a CUDA kernel and this run is on "
                f"{cfg.cluster.device}: use auto, flash or math."]
    if e.cuda_device_max_connections is not None and not 1 <= e.cuda_device_max_connections <= 32:
        return [f"engine.cuda_device_max_connections={e.cuda_device_max_connections} must be 1 to 32 (or null)."]
    if not (is_known(e) and rules(e).CAPABILITIES.megatron_torch_native_paths):
        return []  # the engine's own rules say what it compiles
    if e.tp_comm_overlap and not (cfg.parallel.sp and cfg.parallel.tp > 1):
        return ["engine.tp_comm_overlap=true overlaps sequence parallelism's communication: it needs "
                "parallel.tp>1 and parallel.sp=true."]
    if e.compile_layers and cfg.parallel.tp > 1 and not e.tp_comm_overlap:
        return [COMPILED_MEGATRON_TP]
    return check_layer_spec(cfg, for_launch)


def check_layer_spec(cfg, for_launch: bool = False) -> list[str]:
    """engine.layer_spec=transformer_engine: CUDA, the Megatron-Core model, none of the
    torch-native spec's own keys, and (before a local launch) TE importable here."""
    e = cfg.engine
    if e.layer_spec != "transformer_engine":
        return []
    if not rules(e).builds_megatron_layer_spec(e, cfg.parallel):
        return ["engine.layer_spec=transformer_engine applies to Megatron-Core's GPTModel; this run trains the "
                "Hugging Face model. Fix: engine.layer_spec=auto, or engine.deepspeed_model=megatron."]
    if cfg.cluster.device != "cuda":
        return [f"engine.layer_spec=transformer_engine needs CUDA; cluster '{cfg.cluster.name}' runs on "
                f"{cfg.cluster.device}. Fix: engine.layer_spec=auto."]
    keys = torch_native_asked(e, cfg.precision)
    if keys:
        return [f"engine.layer_spec=transformer_engine with {', '.join(keys)}: "
                f"{'that runs' if len(keys) == 1 else 'those run'} only in the torch-native spec. "
                f"Fix: engine.layer_spec=auto, or {_turned_off(keys)}."]
    if for_launch and cfg.launcher.name == "local":
        return layer_spec_machine_problems(e, cfg.parallel, probe(transformer_engine=True).transformer_engine)
    return []


def _turned_off(keys: list[str]) -> str:
    """The overrides that turn torch_native_asked's keys off, e.g. "engine.compile_layers=false"."""
    off = {"precision.fp8_backend=torchao": "auto", "precision.fp8_recipe=rowwise": "tensorwise"}
    return " ".join(f"{k.split('=')[0]}={off.get(k, 'false')}" for k in keys)


def layer_spec_machine_problems(engine, parallel, te_imports: bool) -> list[str]:
    """Transformer Engine's layers asked for (engine.layer_spec=transformer_engine) where TE
    does not import: said before a local launch, and by every worker at start."""
    if engine.layer_spec != "transformer_engine" or te_imports:
        return []
    if not rules(engine).builds_megatron_layer_spec(engine, parallel):
        return []
    return [LAYER_SPEC_WITHOUT_TE]


LAYER_SPEC_WITHOUT_TE = ("engine.layer_spec=transformer_engine: Transformer Engine cannot be imported here (it needs "
                         "CUDA, cuDNN and its wheel). Fix: engine.layer_spec=auto (the torch-native spec where TE "
                         "is absent).")


def check_tested_releases(launcher, for_launch: bool) -> list[str]:
    """The installed Megatron-Core and torch must be tested releases (a local launch runs on
    this machine; other launchers' workers check their own: at import of megatron_internals,
    and torch's in runtime.worker)."""
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


def check_data(data, model, parallel, launcher) -> list[str]:
    from ..data.data_source import expected_bin_bytes
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
            needed = _documents_needed(d.split)
            out.append(f"dataset files missing: {', '.join(missing)}"
                       + (f"; data.split='{d.split}' needs {needed} documents at least" if needed else "")
                       + f". Fix: python -m gridwright.data.prepare_data --input YOUR_TEXT.jsonl --output-prefix {prefix}")
            continue
        try:
            info = dataset_info(prefix)
            expected = expected_bin_bytes(prefix)
        except (OSError, ValueError) as e:
            out.append(str(e))
            continue
        size = os.path.getsize(prefix + ".bin")
        if size != expected:
            out.append(f"{prefix}.bin holds {size:,} bytes, but {prefix}.idx describes {expected:,}: the dataset is "
                       f"{'truncated' if size < expected else 'not the one its index was written for'}. "
                       f"Fix: {_remake_dataset(prefix, info)}")
            continue
        tokenizers.add(info["tokenizer"])
        out += _data_split_problems(prefix, info["documents"], d)
        if info["vocab_size"] > model.vocab_size:
            tp = max(1, parallel.tp)  # a multiple of TP (the embedding's split); TP<1 is refused elsewhere
            fitting = -(-info["vocab_size"] // tp) * tp
            out.append(
                f"{prefix} was tokenized with a vocabulary of {info['vocab_size']} ({info['tokenizer']}), larger "
                f"than model.vocab_size={model.vocab_size}. Fix: model.vocab_size={fitting}."
            )
    if len(tokenizers) > 1:
        out.append(f"data.paths were made with different tokenizers: {sorted(tokenizers)}.")
    return out


def _remake_dataset(prefix: str, info: dict) -> str:
    """The commands that write `prefix` again from the inputs its .json records
    (prepare_data never overwrites, so the old files go first)."""
    from shlex import quote

    inputs = " ".join(quote(p) for p in info.get("inputs") or ["YOUR_TEXT.jsonl"])
    files = " ".join(quote(prefix + s) for s in (".bin", ".idx", ".json"))
    return (f"rm {files} && python -m gridwright.data.prepare_data --input {inputs} "
            f"--output-prefix {quote(prefix)} --tokenizer {quote(info.get('tokenizer', 'byte'))}")


def _documents_needed(split: str) -> int | None:
    """The fewest documents that give each nonzero share of `split` one (said before a
    dataset is prepared, so that preparing it does not fail on the split next); None for a
    split that does not parse (said where the dataset is read)."""
    try:
        shares = [float(x) for x in split.replace("/", ",").split(",")][:3]
    except ValueError:
        return None
    positive = [share for share in shares if share > 0]
    return max(math.ceil(sum(shares) / share - 1e-9) for share in positive) if positive else None


def _data_split_problems(prefix: str, documents: int, data) -> list[str]:
    """Each split with a nonzero share needs a document (Megatron-Core loops forever on an
    empty one). The Fix gives the starved validation and test shares 0 (and stops validation)."""
    split = data.split
    try:
        shares = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        return [f"data.split='{split}' must be comma-separated numbers, e.g. 98,2,0."]
    total = sum(shares)
    names = ("train", "validation", "test")
    starved = [i for i, share in enumerate(shares[:3]) if share > 0 and documents * share / total < 1]
    fix = {}
    if starved and 0 not in starved:
        fix["data.split"] = "/".join("0" if i in starved else f"{share:g}" for i, share in enumerate(shares))
        if 1 in starved and data.eval_interval:
            fix["data.eval_interval"] = 0
    return [
        f"{prefix} has {documents} documents: the {names[i]} share {shares[i]:g}/{total:g} of data.split='{split}' "
        "gets none. " + _fix(fix, "more documents, or a share of 0 for that split.")
        for i in starved
    ]


def check_checkpoint(cfg) -> list[str]:
    from pathlib import Path

    from ..checkpoints.checkpoint_dir import LATEST, root_problem, writer_problem
    from ..path_rules import system_place

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


def check_nvlink_domains(parallel, model, train, placement: Placement, advise: bool = True) -> list[str]:
    out, layout = [], placement.layout
    d = layout.nvlink_domain_size
    for kind, allow, flag in (
        ("tp", parallel.allow_tp_across_nvlink, "parallel.allow_tp_across_nvlink"),
        ("etp_ep", parallel.allow_ep_across_nvlink, "parallel.allow_ep_across_nvlink"),
    ):
        if allow or (kind == "etp_ep" and not model.num_experts):
            continue
        crossing = placement.groups_crossing_domain(kind, d)
        if crossing:
            what = "tensor-parallel" if kind == "tp" else "expert-parallel (expert-TP x EP)"
            problem = (f"{len(crossing)} {what} group(s) span NVLink domains of {d} GPUs, e.g. ranks "
                       f"{crossing[0]}: their all-reduce / all-to-all would cross the network.")
            out.append(f"{problem} {_domain_fix(model, train, layout, kind, flag)}" if advise else problem)
    return out


def _domain_fix(model, train, layout: ParallelLayout, kind: str, flag: str) -> str:
    """The nearest smaller TP (or EP) whose groups stay inside the NVLink domain and pass the
    layout rules; else the flag that accepts the crossing."""
    d = layout.nvlink_domain_size
    if kind == "tp":
        candidates = _tp_candidates(model, layout, cap=d)
    else:
        candidates = [({"parallel.ep": e}, replace(layout, ep=e))
                      for e in _near(layout.ep, _divisors(model.num_experts)) if e * layout.etp <= d]
    inside = next((o for o, tried in candidates if _layout_passes(model, train, tried)
                   and not plan_placement(tried).groups_crossing_domain(kind, d)), None)
    if inside:
        return f"Fix: {_words(inside)} (the group fits in {d} GPUs), or {flag}=true."
    return f"Fix: {flag}=true (no group of {d} GPUs or fewer passes the layout rules)."


# Of a machine's memory, the share a local CPU run may plan to use: the rest is the system's.
HOST_MEMORY_SHARE = 0.9
# The models to try a pipeline with on a CPU when the chosen one does not fit
TINY_MODELS = {"dense": "tiny_llama", "moe": "tiny_mixtral"}


def check_host_memory(cfg, plan: Plan, for_launch: bool) -> list[str]:
    """A CPU run launched here keeps every process's weights, gradients, Adam state and
    activations in this machine's memory: refuse a model the machine cannot hold, before its
    processes allocate their way into the OOM killer. Other launchers run elsewhere."""
    if cfg.cluster.device != "cpu" or cfg.launcher.name != "local" or not for_launch:
        return []
    processes, have = cfg.cluster.gpus_per_node, host_memory_bytes()
    budget = HOST_MEMORY_SHARE * have

    def fits(tried, layout) -> bool:
        return host_memory_estimate(tried, layout).total_gib * GIB * processes <= budget

    per = host_memory_estimate(cfg, plan.layout, plan.params)
    if per.total_gib * GIB * processes <= budget:
        return []
    found = _memory_fix(cfg, fits, more_nodes=False) or _tiny_model_fix(cfg)
    return [f"model {cfg.model.name} ({plan.params.total / 1e9:.3g} B parameters) needs about "
            f"{per.total_gib * processes:,.1f} GiB on {processes} CPU processes ({per.describe()} each), more than "
            f"{HOST_MEMORY_SHARE:.0%} of this machine's {have / GIB:,.1f} GiB. "
            + _fix(found, "a smaller model")
            + ", or launcher=torchrun or slurm to emit the job for machines that hold it."]


def _tiny_model_fix(cfg) -> dict | None:
    """The tiny model of the same kind (dense or MoE), with a sequence its positions allow."""
    from .compose import CONF_DIR

    name = TINY_MODELS["moe" if cfg.model.num_experts else "dense"]
    if cfg.model.name == name:
        return None
    tiny = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    found = {"model": name}
    if cfg.train.seq_length > tiny.max_position_embeddings:
        found["train.seq_length"] = tiny.max_position_embeddings
    return found


def _memory_fix(cfg, fits, more_nodes: bool) -> dict | None:
    """The least change under which `fits(config, layout)` holds and every layout and engine
    rule passes: under dynamic CP a smaller share of a row per rank first; then full
    recompute, the distributed optimizer, micro-batch 1 (the fewest of these), on the current
    layout, then on more TP or PP, then (GPU clusters) on more nodes."""
    share = _rank_share_fix(cfg, fits)
    if share:
        return share
    levers = [(k, v) for k, v, unset in (
        ("train.recompute", "full", cfg.train.recompute != "full"),
        ("zero.stage", 1, cfg.zero.stage == 0),
        ("train.micro_batch_size", 1, cfg.train.micro_batch_size > 1)) if unset]
    subsets = [dict(c) for n in range(len(levers) + 1) for c in itertools.combinations(levers, n)]
    for layout_change in [{}] + _bigger_layouts(cfg, more_nodes):
        if not _fits_with(cfg, layout_change | dict(levers), fits):
            continue  # every lever on (the least memory there) does not fit this layout
        for subset in subsets:
            if (layout_change or subset) and _fits_with(cfg, layout_change | subset, fits):
                return subset | layout_change
    return None


def _rank_share_fix(cfg, fits) -> dict | None:
    """Dynamic CP: the largest share of a row a rank holds (half a row, a quarter ...) under
    which it fits, tried before any lever that costs compute or adds GPUs; the longer
    documents are then split over more ranks. None: not dynamic CP, or no share fits."""
    if cfg.parallel.cp_mode != "dynamic" or not cfg.data.packing:
        return None
    layout = ParallelLayout.from_config(cfg)
    ranks, seq = layout.dp * layout.cp, cfg.train.seq_length
    longest = longest_document(cfg.data.doc_lengths, seq)
    share = max_seqlen_per_rank(cfg.parallel, seq) // 2
    while share >= 1 and share * ranks >= longest:
        if _fits_with(cfg, {"parallel.max_seqlen_per_rank": share}, fits):
            return {"parallel.max_seqlen_per_rank": share}
        share //= 2
    return None


def _fits_with(cfg, overrides: dict, fits) -> bool:
    """Whether the config `overrides` give fits, and passes the layout, engine and NVLink rules."""
    with _tried(cfg, overrides) as tried:
        layout = ParallelLayout.from_config(tried)
        return (_layout_passes(tried.model, tried.train, layout) and not check_engine(tried, layout, False)
                and fits(tried, layout)
                and not check_nvlink_domains(tried.parallel, tried.model, tried.train, plan_placement(layout),
                                             advise=False))


def _bigger_layouts(cfg, more_nodes: bool) -> list[dict]:
    """More TP (powers of two, within the NVLink domain, at most 8), more PP (divisors of the
    layers) and, where asked, more nodes (up to 64 times as many): fewest GPUs first, then the
    smallest model-parallel group, TP before PP."""
    p, c, m = cfg.parallel, cfg.cluster, cfg.model
    nodes = [c.nodes * 2**k for k in range(7 if more_nodes else 1)]
    tps = [t for t in (1, 2, 4, 8) if p.tp <= t <= c.nvlink_domain_size and m.num_attention_heads % t == 0] or [p.tp]
    pps = [d for d in _divisors(m.num_layers) if d >= p.pp]
    out = []
    for n, t, pp in sorted(itertools.product(nodes, tps, pps), key=lambda x: (x[0], x[1] * x[2], -x[1])):
        if (n, t, pp) == (c.nodes, p.tp, p.pp) or (n * c.gpus_per_node) % (t * pp * p.cp):
            continue
        change = {"cluster.nodes": n} if n != c.nodes else {}
        change |= {"parallel.tp": t} if t != p.tp else {}
        change |= {"parallel.sp": True} if t > 1 and not p.sp else {}
        change |= {"parallel.pp": pp} if pp != p.pp else {}
        out.append(change)
    return out


def _world_size_fix(cfg, layout: ParallelLayout) -> str | None:
    """Where the world size is not divisible by TP*PP*CP: new degrees whose product divides
    it and under which every layout, model and engine rule passes and the memory estimate
    fits the GPU (planning.layout alone would lower the degrees to their divisors: tp=3 on
    16 GPUs became tp=1, which does not fit Llama-3-8B on H100s). The fewest degrees
    changed, then the nearest to those asked (lower first). None: the layout divides the
    world, or nothing found (the layout's own suggestion stands)."""
    world = layout.world_size
    if world % layout.model_parallel_size:
        names = ("tp", "pp", "cp")
        options = [[getattr(layout, n)] + _near(getattr(layout, n), _divisors(world)) for n in names]
        cap, candidates = cfg.cluster.gpu.memory_gib, []
        for values in itertools.product(*options):
            if world % math.prod(values):
                continue
            changed = {f"parallel.{n}": v for n, v, was in zip(names, values, (o[0] for o in options)) if v != was}
            cost = sum(o.index(v) for o, v in zip(options, values))
            candidates.append((len(changed), cost, changed))

        def fits(tried, tried_layout) -> bool:
            est = estimate_memory(tried, tried_layout)
            return est is None or cap <= 0 or est.total_gib <= cap

        for _, _, changed in sorted(candidates, key=lambda c: c[:2]):
            tp = changed.get("parallel.tp", layout.tp)
            sp = (layout.sp or bool(cfg.model.num_experts)) if tp > 1 else False
            found = changed | ({"parallel.sp": sp} if sp != layout.sp else {})
            if changed.get("parallel.pp", layout.pp) == 1 and layout.vpp is not None:
                found["parallel.vpp"] = None
            if _fits_with(cfg, found, fits):
                return _words(found)
    return None


def check_memory(cfg, plan: Plan) -> list[str]:
    """The plan's per-GPU estimate (GPU clusters only) against the GPU's memory."""
    est, gpu = plan.memory, cfg.cluster.gpu
    cap = gpu.memory_gib
    if est is None or cap <= 0 or est.total_gib <= cap:
        return []

    def fits(tried, layout) -> bool:
        return estimate_memory(tried, layout).total_gib <= cap

    found = _memory_fix(cfg, fits, more_nodes=True)
    if found:
        with _tried(cfg, found) as tried:
            after = estimate_memory(tried, ParallelLayout.from_config(tried)).total_gib
        if "cluster.nodes" in found and cfg.launcher.name == "local":
            found["launcher"] = "torchrun"
        fix = f"Fix: {_words(found)} (estimated {after:.1f} GiB per GPU)."
    else:
        fix = "Fix: fewer layers or a smaller model (no recompute, ZeRO-1, TP/PP or node count up to 64 times fits it)."
    return [f"estimated memory per GPU {est.describe()} exceeds {gpu.name}'s {cap:.1f} GiB. {fix}"]


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg, for_launch: bool = True) -> Plan:
    """Check everything; return the plan (derived once, here), or raise ConfigError."""
    count_problems = check_counts(cfg.model, cfg.train, cfg.cluster)
    # Where it runs comes first: on a machine without the cluster's GPUs, the first Fix says where to go.
    problems = check_launcher(cfg.launcher, cfg.cluster, for_launch)
    problems += check_choices(cfg) + count_problems + check_numbers(cfg) + check_paths(cfg)
    layout = ParallelLayout.from_config(cfg)
    counts_ok = not count_problems  # else the layout's arithmetic would divide by zero
    world_fix = _world_size_fix(cfg, layout) if counts_ok else None
    layout_problems = layout.problems(dense_fix=world_fix) if counts_ok else []
    problems += layout_problems
    if counts_ok:  # how the degrees divide the model, beside any grid problem: every problem at once
        problems += check_model_split(cfg.model, cfg.train, layout, world_fix)
    if counts_ok and not layout_problems:
        problems += check_context_parallel(cfg.train, layout, cfg.model)
        problems += check_cp_comm_type(cfg.parallel, cfg.data, cfg.model, layout)
        problems += check_batch(cfg.train, layout)
        problems += check_packing(cfg.data, cfg.parallel, cfg.train, cfg.model, layout)
        problems += check_engine(cfg, layout, for_launch)
    problems += check_precision(cfg, for_launch)
    problems += check_torch_native_paths(cfg, for_launch)
    problems += check_tested_releases(cfg.launcher, for_launch)
    problems += check_tracking(cfg.tracking, cfg.launcher)
    problems += check_checkpoint(cfg)
    problems += check_data(cfg.data, cfg.model, cfg.parallel, cfg.launcher)
    problems += check_evaluate(cfg.evaluate, cfg.train, cfg.cluster)
    plan = None
    if not problems:
        placement = plan_placement(layout)
        problems += check_nvlink_domains(cfg.parallel, cfg.model, cfg.train, placement)
        try:
            plan = derive_plan(cfg, layout, placement)
        except CommProfileProblem as e:
            problems.append(str(e))
    if plan is not None:
        problems += check_memory(cfg, plan)
        problems += check_host_memory(cfg, plan, for_launch)
    elif counts_ok and not layout_problems and os.path.isfile(cfg.cluster.comm_profile or ""):
        try:  # no plan for an invalid config, but a profile that cannot price it is one more fix to list
            predict_communication(cfg, layout)
        except CommProfileProblem as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(problems)
    return plan
