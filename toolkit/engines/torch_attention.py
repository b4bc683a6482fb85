"""The attention computations of the torch-native layer spec (`megatron_model.SDPACoreAttention`),
without Transformer Engine: causal SDPA, context parallelism by gathering keys and values
or by all-to-all, and packed documents (THD), where attention stays inside each document.

Tensors are [b, heads, s, dim] for whole sequences and [t, heads, dim] for packed ones.
Context parallelism follows Megatron-Core's load-balanced layout: a sequence (or, packed,
each document) is cut into 2·CP chunks and rank r holds chunks r and 2·CP-1-r, which is
what `get_batch_on_this_cp_rank` and its THD rope (`rope_utils._get_thd_freqs_on_this_cp_rank`)
assume.
"""
from __future__ import annotations

import inspect
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.device_copy import to_device


class _GatherSequence(torch.autograd.Function):
    """All-gather along a CP group; the backward sums every rank's gradient and keeps
    this rank's slice. (torch.distributed.nn's all_gather relies on reduce_scatter, which
    gloo lacks.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over a group in equal parts along dim 0. The exchange is its own
    adjoint (part j of rank r goes to part r of rank j), so the backward repeats it on the
    gradient. Written here rather than torch.distributed.nn's, whose backward aborted on
    gloo in a trial (torch 2.13)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def causal_sdpa(q, k, v, scale=None, dropout=0.0, lower_right=None):
    """Causal SDPA on [b, heads, s, dim]; `lower_right` = (queries, keys) aligns the causal
    diagonal to the last key (queries that come after keys[:-queries]), as flash attention
    does."""
    from torch.nn.attention.bias import causal_lower_right

    mask = None if lower_right is None else causal_lower_right(*lower_right)
    if mask is not None and k.shape[1] != q.shape[1]:
        # The lower-right causal path calls the flash kernel without GQA: give it every head.
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


# Eager inside compiled layers: dynamo cannot trace SDPA's lower-right causal bias (torch
# 2.11), and a graph break in the chunk loop would drop the whole frame to eager with a
# recompile per shape anyway; the attention kernels are the same either way.
@torch.compiler.disable
def context_parallel(q, k, v, group, scale=None, dropout=0.0):
    """Context parallelism over `group`: every rank's keys and values gathered, then one
    causal SDPA per local chunk over the keys before it (both halves together see 2·CP+1
    chunks of keys on every rank). Each call is a lower-right causal mask, which SDPA's
    flash and memory-efficient kernels take natively: no S x S mask is ever built. Keys and
    values are gathered whole (memory O(s) per rank, communication not overlapped), unlike
    a ring; with GQA they are the small tensors. TE's ring attention is the path where TE
    exists."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    half = q.shape[2] // 2
    keys = _gather_chunks_in_order(k, group, size)  # [b, groups, s, dim], global order
    values = _gather_chunks_in_order(v, group, size)
    outs = []
    for local, chunk in ((0, rank), (1, 2 * size - 1 - rank)):
        end = (chunk + 1) * half
        outs.append(causal_sdpa(q[:, :, local * half:(local + 1) * half], keys[:, :, :end],
                                values[:, :, :end], scale, dropout, (half, end)))
    return torch.cat(outs, dim=2)


@torch.compiler.disable  # collectives inside a custom autograd function: eager, as context_parallel
def context_parallel_a2a(q, k, v, group, scale=None, dropout=0.0):
    """Context parallelism by all-to-all (the form of DeepSpeed-Ulysses; `parallel.cp_comm_type=a2a`):
    one exchange turns each rank's [its two chunks of the sequence, all heads] into [the
    whole sequence, 1/CP of the heads and key/value groups], one causal SDPA runs on it,
    and a second exchange returns each rank its chunks for every head. Per layer that is
    two collectives and one attention call, against the all-gather form's two gathers and
    two lower-right calls; the exchanges carry the queries and outputs too, so more bytes
    move. Needs heads and groups divisible by CP (validation.check_cp_comm_type)."""
    size = dist.get_world_size(group)
    b, heads, s_local, dim = q.shape
    groups, half = k.shape[1], s_local // 2
    h_part, g_part = heads // size, groups // size

    def by_destination(x):  # [b, n, s_local, dim] -> [cp, b, n/cp, s_local, dim]: part j goes to rank j
        return x.view(b, size, x.shape[1] // size, s_local, dim).transpose(0, 1)

    sent = torch.cat([by_destination(x) for x in (q, k, v)], dim=2)
    got = _AllToAll.apply(sent, group).view(size, b, h_part + 2 * g_part, 2, half, dim)
    # Source rank r sent chunks r and 2·CP-1-r: put the 2·CP chunks in sequence order.
    chunks = torch.cat([got[:, :, :, 0], got[:, :, :, 1].flip(0)])  # [2cp, b, n, half, dim]
    whole = chunks.permute(1, 2, 0, 3, 4).reshape(b, h_part + 2 * g_part, 2 * size * half, dim)
    qh, kh, vh = whole.split([h_part, g_part, g_part], dim=1)
    out = causal_sdpa(qh, kh, vh, scale, dropout).view(b, h_part, 2 * size, half, dim)
    # Rank j gets back chunks j and 2·CP-1-j of this rank's heads.
    back = torch.stack([out[:, :, :size], out[:, :, size:].flip(2)], dim=3)  # [b, h_part, cp, 2, half, dim]
    back = back.permute(2, 0, 1, 3, 4, 5).reshape(size, b, h_part, s_local, dim)
    got = _AllToAll.apply(back, group)  # [cp (whose heads), b, h_part, s_local, dim]
    return got.transpose(0, 1).reshape(b, heads, s_local, dim)


def _gather_chunks_in_order(x, group, size):
    """[b, heads, s_local, dim] of every CP rank -> [b, heads, s, dim] in global order
    (rank r holds chunks r and 2*CP-1-r)."""
    parts = _GatherSequence.apply(x.transpose(0, 2), group)  # [cp, s_local, heads, b, dim]
    half = x.shape[2] // 2
    chunks = [None] * (2 * size)
    for r in range(size):
        chunks[r] = parts[r, :half]
        chunks[2 * size - 1 - r] = parts[r, half:]
    return torch.cat(chunks).transpose(0, 2)


def _varlen_kernel():
    """torch's varlen flash attention (torch.nn.attention.varlen) when this build has it and
    its causal switch is one we know: torch 2.13 takes `window_size=(-1, 0)`, torch 2.9-2.12
    `is_causal=True`. CUDA only."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, None
    params = inspect.signature(varlen_attn).parameters
    # torch 2.11 has no enable_gqa: key/value heads are then repeated for it (`documents`).
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0), **gqa}
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True, **gqa}
    return None, None


def thd_params(cu_seqlens, longest: int, device, te_layers: bool = False):
    """Megatron-Core's PackedSeqParams for a THD micro-batch. For the torch-native spec its
    `cu_seqlens` stay on the host: Megatron-Core's THD rope reads them with `.tolist()` in
    every layer (rope_utils._apply_rotary_pos_emb_thd), which on the GPU would wait for the
    device each time; the device copy the kernels need rides along as `cu_seqlens_device`.
    `te_layers`: Transformer Engine's fused attention and fused THD rope read `cu_seqlens`
    on the GPU, so they go there."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to("cpu", torch.int32)
    on_device = to_device(cu, device)
    given = on_device if te_layers else cu
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=given, cu_seqlens_kv=given,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    params.cu_seqlens_device = on_device
    return params


def _on_kernel(q, dropout) -> bool:
    kernel, _ = _varlen_kernel()
    return kernel is not None and q.is_cuda and dropout == 0.0 and q.dtype in (torch.bfloat16, torch.float16)


def prefix_attention(q, k, v, q_lens: list[int], k_lens: list[int], cu_q=None, cu_k=None, scale=None, dropout=0.0):
    """Segments of packed queries, each attending to its own segment of packed keys with the
    causal diagonal at the segment's last key (query j of a segment of n queries and m keys
    sees keys 0 .. m-n+j). [t_q, heads, dim] x [t_k, groups, dim] -> [t_q, heads, dim].
    On CUDA one varlen flash call (flash attention's causal mask is aligned to the bottom
    right when queries are fewer than keys); elsewhere one SDPA per segment."""
    if _on_kernel(q, dropout):
        kernel, causal = _varlen_kernel()
        if k.shape[1] != q.shape[1] and "enable_gqa" not in causal:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if cu_q is None:
            cu_q = to_device(torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32), q.device)
        if cu_k is None:
            cu_k = to_device(torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32), q.device)
        return kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale=scale, **causal)
    outs, at_q, at_k = [], 0, 0
    for n, m in zip(q_lens, k_lens):
        part_q = q[at_q:at_q + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        part_k, part_v = (x[at_k:at_k + m].transpose(0, 1).unsqueeze(0) for x in (k, v))
        lower_right = None if n == m else (n, m)
        outs.append(causal_sdpa(part_q, part_k, part_v, scale, dropout, lower_right)[0].transpose(0, 1))
        at_q, at_k = at_q + n, at_k + m
    return torch.cat(outs)


@torch.compiler.disable
def documents(q, k, v, params, scale=None, dropout=0.0):
    """Causal attention inside each packed document of `params` (thd_params):
    [t, heads, dim] -> [t, heads, dim], no mask built."""
    lengths = params.cu_seqlens_q.diff().tolist()  # host tensor: no wait for the device
    device_cu = getattr(params, "cu_seqlens_device", None)
    return prefix_attention(q, k, v, lengths, lengths, device_cu, device_cu, scale, dropout)


@torch.compiler.disable
def context_parallel_documents(q, k, v, params, group, scale=None, dropout=0.0):
    """Packed documents under context parallelism: `params.cu_seqlens_q` are the whole
    documents' (padded) bounds; this rank holds chunks r and 2·CP-1-r of each document, in
    document order. Keys and values are gathered from the group once per layer; each local
    chunk then attends to its document's keys before it: one `prefix_attention` over every
    chunk, whose keys are picked from the gathered ones by an index built once per
    micro-batch (`_cp_plan`)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    plan = params.__dict__.get("gridwright_cp_plan")
    if plan is None:
        plan = params.gridwright_cp_plan = _cp_plan(params.cu_seqlens_q.tolist(), rank, size, q.device)
    keys = _GatherSequence.apply(k, group).flatten(0, 1)  # [cp * t_local, groups, dim]
    values = _GatherSequence.apply(v, group).flatten(0, 1)
    index, q_lens, k_lens, cu_q, cu_k = plan
    return prefix_attention(q, keys.index_select(0, index), values.index_select(0, index), q_lens, k_lens,
                            cu_q, cu_k, scale, dropout)


def _cp_plan(bounds: list[int], rank: int, size: int, device):
    """For `context_parallel_documents`: the gathered rows each local chunk attends to (its
    document's tokens up to the chunk's end, in global order), with the segment lengths."""
    import numpy as np

    t_local = bounds[-1] // size
    rows, q_lens, k_lens = [], [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        half = (end - start) // (2 * size)
        local = start // size
        # chunk c of the document sits on rank c (first half of its local share) or on rank
        # 2·size-1-c (second half); gathered row of (rank p, local position i): p·t_local + i
        order = np.concatenate([
            np.arange(half) + (c if c < size else 2 * size - 1 - c) * t_local + local + (0 if c < size else half)
            for c in range(2 * size)])
        for chunk in (rank, 2 * size - 1 - rank):
            rows.append(order[:(chunk + 1) * half])
            q_lens.append(half)
            k_lens.append((chunk + 1) * half)
    index = to_device(torch.from_numpy(np.concatenate(rows)), device)
    cu = lambda lens: to_device(torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32), device)  # noqa: E731
    on_cuda = torch.device(device).type == "cuda"
    return index, q_lens, k_lens, cu(q_lens) if on_cuda else None, cu(k_lens) if on_cuda else None
