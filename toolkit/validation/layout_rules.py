"""The rules of how a layout splits the model: heads, query groups, FFN and vocabulary by TP,
layers by PP and VPP, experts by EP, the sequence by CP, the batch by DP, packed documents,
and NVLink domains; each Fix is a degree tried against all of them.
"""
from __future__ import annotations

import math
from dataclasses import replace
from ..families.hf_config import family_problems
from ..data.packing import longest_document
from ..families.registry import FAMILIES
from ..planning.layout import ParallelLayout, a2a_splits_heads, heads_per_tp_rank, max_seqlen_per_rank
from ..planning.placement import Placement, plan_placement
from .fix_advice import divisors, fix_text, nearest_first, override_words


def layout_passes(model, train, layout: ParallelLayout) -> bool:
    """Whether a candidate layout passes every rule that depends on it: a degree or batch
    offered as a fix is tried against these first."""
    return not (layout.problems() or _division_problems(model, train, layout, advise=False)
                or check_context_parallel(train, layout, model) or check_batch(train, layout))


def first_passing(model, train, candidates) -> dict | None:
    """The overrides of the first (overrides, layout) candidate whose layout passes."""
    return next((overrides for overrides, layout in candidates if layout_passes(model, train, layout)), None)


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
        return fix_text(first_passing(m, train, candidates) if advise else None, otherwise)

    tp_fix = ""
    for size, path in ((m.num_attention_heads, "model.num_attention_heads"), (m.num_query_groups, "model.num_query_groups"),
                       (m.ffn_hidden_size, "model.ffn_hidden_size"), (m.vocab_size, "model.vocab_size")):
        if size % tp:
            tp_fix = tp_fix or fix(_tp_candidates(m, layout), f"choose a TP that divides {path}={size}.")
            out.append(f"{path}={size} is not divisible by parallel.tp={tp}{TP_SPLITS.get(path, '')}. {tp_fix}")
    if m.num_layers % pp:
        pp_candidates = [({"parallel.pp": d} | ({"parallel.vpp": None} if vpp != layout.vpp else {}),
                          replace(layout, pp=d, vpp=vpp))
                         for d in nearest_first(pp, divisors(m.num_layers))
                         for vpp in dict.fromkeys((layout.vpp if d > 1 else None, None))]
        out.append(
            f"model.num_layers={m.num_layers} is not divisible by parallel.pp={pp}. "
            + fix(pp_candidates, f"choose a PP among {divisors(m.num_layers)}.")
        )
    elif layout.vpp and (m.num_layers // pp) % layout.vpp:
        per_stage = m.num_layers // pp
        vpp_candidates = [({"parallel.vpp": v}, replace(layout, vpp=v))
                          for v in nearest_first(layout.vpp, divisors(per_stage)) if v > 1] + [
                         ({"parallel.vpp": None}, replace(layout, vpp=None))]
        out.append(
            f"model.num_layers={m.num_layers} over parallel.pp={pp} gives {per_stage} layers "
            f"per stage, not divisible into parallel.vpp={layout.vpp} virtual stages. "
            + fix(vpp_candidates, f"choose a VPP among {divisors(per_stage)}.")
        )
    if m.num_experts:
        if m.num_experts % layout.ep:
            ep_candidates = [({"parallel.ep": d}, replace(layout, ep=d)) for d in nearest_first(layout.ep, divisors(m.num_experts))]
            out.append(
                f"model.num_experts={m.num_experts} is not divisible by parallel.ep={layout.ep}. "
                + fix(ep_candidates, f"choose an EP among {divisors(m.num_experts)}.")
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
            f"which has no experts. Fix: {override_words(dense)}, or pick an MoE model."
        )
    return out


def _tp_candidates(model, layout: ParallelLayout, cap: int | None = None) -> list[tuple[dict, ParallelLayout]]:
    """Other TPs that divide the attention heads, nearest first (at most `cap`), each with
    the sequence parallelism it needs: on for an MoE model, off at TP=1."""
    out = []
    for d in nearest_first(layout.tp, divisors(model.num_attention_heads)):
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
    if not a2a_splits_heads(model, layout.tp, layout.cp):
        heads, groups = heads_per_tp_rank(model, layout.tp)
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
    if parallel.cp_scheduler != "gridwright" and not dynamic:
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
    micro = train.global_batch_size // unit
    if layout.vpp and layout.pp > 1 and micro % layout.pp:
        # Megatron-Core's interleaved schedule runs micro-batches in groups of PP per virtual
        # stage (microbatch_group_size_per_vp_stage) and refuses a remainder: it would stall.
        whole = unit * layout.pp
        return [
            f"train.global_batch_size={train.global_batch_size} gives {micro} micro-batch(es) per step, and the "
            f"interleaved schedule (parallel.vpp={layout.vpp}) needs a multiple of PP={layout.pp}. "
            f"Fix: train.global_batch_size={-(-train.global_batch_size // whole) * whole} (a multiple of {whole})."
        ]
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
                      for e in nearest_first(layout.ep, divisors(model.num_experts)) if e * layout.etp <= d]
    inside = next((o for o, tried in candidates if layout_passes(model, train, tried)
                   and not plan_placement(tried).groups_crossing_domain(kind, d)), None)
    if inside:
        return f"Fix: {override_words(inside)} (the group fits in {d} GPUs), or {flag}=true."
    return f"Fix: {flag}=true (no group of {d} GPUs or fewer passes the layout rules)."
