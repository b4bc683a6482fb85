"""Megatron-Core's process groups for a run's layout, and what they turned out to be: used
by the Megatron engine and by DeepSpeed over Megatron-Core tensor parallelism."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from ..planning.layout import ParallelLayout
from .timeouts import collective_timeout


def init_parallel(cluster, watchdog, layout: ParallelLayout, hybrid_cp: bool = False, longest_bound_s: float = 0.0):
    """torch.distributed (gloo on CPU, NCCL on GPUs) and Megatron-Core's process groups,
    with the watchdog's collective timeout; `hybrid_cp` adds the groups of 2, 4 ... DP
    ranks dynamic context parallelism runs documents on."""
    from megatron.core import parallel_state as ps

    on_cpu = cluster.device == "cpu"
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "gloo" if on_cpu else "nccl"
    timeout = collective_timeout(watchdog, backend, longest_bound_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"torchrun started {dist.get_world_size()} processes but the plan has {layout.world_size}"
        )
    ps.initialize_model_parallel(**layout.megatron_sizes(), order=layout.order, hybrid_context_parallel=hybrid_cp,
                                 distributed_timeout_minutes=max(1, math.ceil(timeout.total_seconds() / 60)))


def observed_coordinates() -> dict:
    """This rank's coordinates and group members as Megatron-Core actually built them."""
    from megatron.core import parallel_state as ps

    def members(group):
        return dist.get_process_group_ranks(group)

    return {
        "rank": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
        "groups": {
            "tp": members(ps.get_tensor_model_parallel_group()),
            "pp": members(ps.get_pipeline_model_parallel_group()),
            "dp": members(ps.get_data_parallel_group()),
            "cp": members(ps.get_context_parallel_group()),
            "ep": members(ps.get_expert_model_parallel_group()),
            "etp": members(ps.get_expert_tensor_parallel_group()),
            "edp": members(ps.get_expert_data_parallel_group()),
        },
    }
