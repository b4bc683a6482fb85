"""The rules of memory: the plan's per-GPU estimate against the GPU, a CPU run's processes
against this machine, and the fixes found by trying layouts and levers that fit (a world
size's too).
"""
from __future__ import annotations

import itertools
import math
from omegaconf import OmegaConf

from ..basics.conf_dir import CONF_DIR
from ..data.packing import longest_document
from ..engine_rules.registry import rules
from ..planning.layout import ParallelLayout, max_seqlen_per_rank
from ..runtime.machine_probe import host_memory_bytes
from ..planning.memory_estimate import GIB, estimate_memory, host_memory_estimate
from ..planning.placement import plan_placement
from ..planning.plan import CommProfileProblem, Plan, derive_plan
from .fix_advice import (divisors, fix_overrides, fix_text, nearest_first, option_keys, override_words, tried_with,
                         yaml_value)
from .input_rules import check_engine
from .layout_rules import check_nvlink_domains, layout_passes


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
        return host_memory_estimate(tried, layout, rules(tried.engine)).total_gib * GIB * processes <= budget

    per = host_memory_estimate(cfg, plan.layout, rules(cfg.engine), plan.params)
    if per.total_gib * GIB * processes <= budget:
        return []
    found = _memory_fix(cfg, fits, more_nodes=False) or _tiny_model_fix(cfg.model, cfg.train)
    return [f"model {cfg.model.name} ({plan.params.total / 1e9:.3g} B parameters) needs about "
            f"{per.total_gib * processes:,.1f} GiB on {processes} CPU processes ({per.describe()} each), more than "
            f"{HOST_MEMORY_SHARE:.0%} of this machine's {have / GIB:,.1f} GiB. "
            + fix_text(found, "a smaller model")
            + ", or launcher=torchrun or slurm to emit the job for machines that hold it."]


def _tiny_model_fix(model, train) -> dict | None:
    """The tiny model of the same kind (dense or MoE), with a sequence its positions allow."""
    name = TINY_MODELS["moe" if model.num_experts else "dense"]
    if model.name == name:
        return None
    tiny = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    found = {"model": name}
    if train.seq_length > tiny.max_position_embeddings:
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
    for layout_change in [{}] + _bigger_layouts(cfg.parallel, cfg.cluster, cfg.model, more_nodes):
        if not fits_with(cfg, layout_change | dict(levers), fits):
            continue  # every lever on (the least memory there) does not fit this layout
        for subset in subsets:
            if (layout_change or subset) and fits_with(cfg, layout_change | subset, fits):
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
        if fits_with(cfg, {"parallel.max_seqlen_per_rank": share}, fits):
            return {"parallel.max_seqlen_per_rank": share}
        share //= 2
    return None


def fits_with(cfg, overrides: dict, fits) -> bool:
    """Whether the config `overrides` give fits, and passes the layout, engine and NVLink rules."""
    with tried_with(cfg, overrides) as tried:
        layout = ParallelLayout.from_config(tried)
        return (layout_passes(tried.model, tried.train, layout) and not check_engine(tried, layout, False)
                and fits(tried, layout)
                and not check_nvlink_domains(tried.parallel, tried.model, tried.train, plan_placement(layout),
                                             advise=False))


def _bigger_layouts(parallel, cluster, model, more_nodes: bool) -> list[dict]:
    """More TP (powers of two, within the NVLink domain, at most 8), more PP (divisors of the
    layers) and, where asked, more nodes (up to 64 times as many): fewest GPUs first, then the
    smallest model-parallel group, TP before PP."""
    p, c, m = parallel, cluster, model
    nodes = [c.nodes * 2**k for k in range(7 if more_nodes else 1)]
    tps = [t for t in (1, 2, 4, 8) if p.tp <= t <= c.nvlink_domain_size and m.num_attention_heads % t == 0] or [p.tp]
    pps = [d for d in divisors(m.num_layers) if d >= p.pp]
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


def world_size_fix(cfg, layout: ParallelLayout) -> str | None:
    """Where the world size is not divisible by TP*PP*CP: new degrees whose product divides
    it and under which every layout, model and engine rule passes and the memory estimate
    fits the GPU (planning.layout alone would lower the degrees to their divisors: tp=3 on
    16 GPUs became tp=1, which does not fit Llama-3-8B on H100s). The fewest degrees
    changed, then the nearest to those asked (lower first). None: the layout divides the
    world, or nothing found (the layout's own suggestion stands)."""
    world = layout.world_size
    if world % layout.model_parallel_size:
        names = ("tp", "pp", "cp")
        options = [[getattr(layout, n)] + nearest_first(getattr(layout, n), divisors(world)) for n in names]
        cap, candidates = cfg.cluster.gpu.memory_gib, []
        for values in itertools.product(*options):
            if world % math.prod(values):
                continue
            changed = {f"parallel.{n}": v for n, v, was in zip(names, values, (o[0] for o in options)) if v != was}
            cost = sum(o.index(v) for o, v in zip(options, values))
            candidates.append((len(changed), cost, changed))

        def fits(tried, tried_layout) -> bool:
            est = estimate_memory(tried, tried_layout, rules(tried.engine))
            return est is None or cap <= 0 or est.total_gib <= cap

        for _, _, changed in sorted(candidates, key=lambda c: c[:2]):
            tp = changed.get("parallel.tp", layout.tp)
            sp = (layout.sp or bool(cfg.model.num_experts)) if tp > 1 else False
            found = changed | ({"parallel.sp": sp} if sp != layout.sp else {})
            if changed.get("parallel.pp", layout.pp) == 1 and layout.vpp is not None:
                found["parallel.vpp"] = None
            if fits_with(cfg, found, fits):
                return override_words(found)
    return None


def check_memory(cfg, plan: Plan) -> list[str]:
    """The plan's per-GPU estimate (GPU clusters only) against the GPU's memory."""
    est, gpu = plan.memory, cfg.cluster.gpu
    cap = gpu.memory_gib
    if est is None or cap <= 0 or est.total_gib <= cap:
        return []

    def fits(tried, layout) -> bool:
        return estimate_memory(tried, layout, rules(tried.engine)).total_gib <= cap

    found = _memory_fix(cfg, fits, more_nodes=True)
    if found:
        with tried_with(cfg, found) as tried:
            after = estimate_memory(tried, ParallelLayout.from_config(tried), rules(tried.engine)).total_gib
        if "cluster.nodes" in found and cfg.launcher.name == "local":
            found["launcher"] = "torchrun"
        fix = f"Fix: {override_words(found)} (estimated {after:.1f} GiB per GPU)."
    else:
        fix = "Fix: fewer layers or a smaller model (no recompute, ZeRO-1, TP/PP or node count up to 64 times fits it)."
    return [f"estimated memory per GPU {est.describe()} exceeds {gpu.name}'s {cap:.1f} GiB. {fix}"]


def fix_that_fits(cfg, problem: str) -> str:
    """`problem` with its Fix extended by the memory Fix of the config the Fix leaves, where
    that config (its layout valid) would not fit the GPU: following the first Fix then gives
    a run that fits, in one step. A Fix of key overrides or a group's option (whose file's
    values are tried as that group's keys); others, and Fixes that fit, are left as they are."""
    overrides = fix_overrides(problem)
    if not overrides or cfg.cluster.device != "cuda":
        return problem
    trial = _as_keys(cfg, overrides)
    if trial is None:
        return problem
    with tried_with(cfg, trial) as tried:
        layout = ParallelLayout.from_config(tried)
        if layout.problems():
            return problem
        try:
            memory = check_memory(tried, derive_plan(tried, layout, plan_placement(layout), rules(tried.engine)))
        except CommProfileProblem:  # the config the Fix leaves cannot be priced: its own refusal says why
            return problem
    more = fix_overrides(memory[0]) if memory else None
    if not more:
        return problem
    words = " ".join(overrides)
    merged = dict(word.split("=", 1) for word in overrides) | dict(word.split("=", 1) for word in more)
    return problem.replace(f"Fix: {words}", f"Fix: {' '.join(f'{k}={v}' for k, v in merged.items())}", 1)


def _as_keys(cfg, overrides: list[str]) -> dict | None:
    """Overrides as dotted keys and values: `group=option` becomes that option's file's values
    under the group; None where one is neither a key of `cfg` nor a group's option."""
    out = {}
    for word in overrides:
        key, _, value = word.partition("=")
        option = option_keys(key, value)
        if option is not None:
            out |= option
        elif OmegaConf.select(cfg, key, default="absent") != "absent":
            out[key] = yaml_value(value)
        else:
            return None
    return out
