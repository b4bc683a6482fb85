"""Both forms of context parallelism (all-gather and all-to-all) against one process's causal
attention: outputs and the gradients of queries, keys and values, on CP=2 and CP=4 gloo
process groups, with GQA and Megatron-Core's load-balanced chunks (rank r holds chunks r
and 2·CP-1-r)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gridwright.engines import torch_attention
from gridwright.runtime.loopback import free_port

B, HEADS, GROUPS, S, DIM = 2, 8, 4, 48, 16


def _inputs():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, HEADS, S, DIM, generator=g)
    k, v = (torch.randn(B, GROUPS, S, DIM, generator=g) for _ in range(2))
    weight = torch.randn(B, HEADS, S, DIM, generator=g)  # the loss is sum(out * weight)
    return q, k, v, weight


def _mine(x, rank, size):
    """This rank's two chunks of the sequence (dim 2), as get_batch_on_this_cp_rank cuts them."""
    chunks = x.chunk(2 * size, dim=2)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=2)


def _worker(rank, size, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    q, k, v, weight = _inputs()
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = torch_attention.causal_sdpa(*full)
    (reference * weight).sum().backward()
    errors = {}
    for name, form in (("all_gather", torch_attention.context_parallel), ("a2a", torch_attention.context_parallel_a2a)):
        local = [_mine(x, rank, size).clone().requires_grad_() for x in (q, k, v)]
        got = form(*local, dist.group.WORLD)
        (got * _mine(weight, rank, size)).sum().backward()
        errors[name] = max([(got - _mine(reference, rank, size)).abs().max().item()]
                           + [(x.grad - _mine(f.grad, rank, size)).abs().max().item() for x, f in zip(local, full)])
    out[rank] = errors
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_both_forms_equal_one_process(size):
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(size, port, out), nprocs=size)
    for rank in range(size):
        for form, error in out[rank].items():
            assert error < 1e-5, (size, rank, form, error)
