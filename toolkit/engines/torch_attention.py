"""The attention computations of the torch-native layer spec (`megatron_model.SDPACoreAttention`),
without Transformer Engine: causal SDPA, context parallelism by gathering keys and values,
and packed documents (THD), where attention stays inside each document.

Tensors are [b, heads, s, dim] for whole sequences and [t, heads, dim] for packed ones.
Context parallelism follows Megatron-Core's load-balanced layout: a sequence (or, packed,
each document) is cut into 2·CP chunks and rank r holds chunks r and 2·CP-1-r, which is
what `get_batch_on_this_cp_rank` and its THD rope (`rope_utils._get_thd_freqs_on_this_cp_rank`)
assume.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F


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


@torch.compiler.disable
def documents(q, k, v, cu_seqlens, scale=None, dropout=0.0):
    """Causal attention inside each packed document: [t, heads, dim] -> [t, heads, dim].
    On CUDA one varlen flash call covers every document (no mask is built); elsewhere (the
    CPU, dropout) one SDPA per document: the same result, the reference the tests use."""
    kernel, causal = _varlen_kernel()
    if kernel is not None and q.is_cuda and dropout == 0.0 and q.dtype in (torch.bfloat16, torch.float16):
        cu = cu_seqlens.to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        if k.shape[1] != q.shape[1] and "enable_gqa" not in causal:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return kernel(q, k, v, cu, cu, longest, longest, scale=scale, **causal)
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        part = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, heads, l, dim]
        outs.append(causal_sdpa(*part, scale=scale, dropout=dropout)[0].transpose(0, 1))
    return torch.cat(outs)


@torch.compiler.disable
def context_parallel_documents(q, k, v, cu_seqlens, group, scale=None, dropout=0.0):
    """Packed documents under context parallelism: `cu_seqlens` are the whole documents'
    (padded) bounds; this rank holds chunks r and 2·CP-1-r of each document, in document
    order. Keys and values are gathered from the group once per layer; each local chunk
    then attends to its document's keys before it (lower-right causal)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    keys = _GatherSequence.apply(k, group)  # [cp, t_local, groups, dim]
    values = _GatherSequence.apply(v, group)
    bounds = [b // size for b in cu_seqlens.tolist()]  # local bounds, the same on every rank
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        half = (end - start) // 2
        doc_k, doc_v = (_document_in_order(x, start, half, size) for x in (keys, values))
        for local, chunk in ((0, rank), (1, 2 * size - 1 - rank)):
            last = (chunk + 1) * half
            part_q = q[start + local * half:start + (local + 1) * half].transpose(0, 1).unsqueeze(0)
            part_k, part_v = (x[:last].transpose(0, 1).unsqueeze(0) for x in (doc_k, doc_v))
            out = causal_sdpa(part_q, part_k, part_v, scale, dropout, (half, last))
            outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def _document_in_order(parts, start, half, size):
    """One document's tokens in global order from the gathered [cp, t_local, ...] parts."""
    chunks = [None] * (2 * size)
    for r in range(size):
        chunks[r] = parts[r, start:start + half]
        chunks[2 * size - 1 - r] = parts[r, start + half:start + 2 * half]
    return torch.cat(chunks)
