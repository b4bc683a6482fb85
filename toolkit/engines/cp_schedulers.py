"""Who runs which document under dynamic context parallelism (`parallel.cp_scheduler`):
a document of length L gets CP size k, the next power of two of L / max_seqlen_per_rank
(Megatron-Core's `gpus_needed`), and runs on an aligned block of k DP ranks
[j·k, (j+1)·k), the hybrid groups Megatron-Core builds.

- `megatron`: Megatron-Core's BalancedCPScheduler (pipeline_parallel/hybrid_cp_schedule.py),
  as Megatron-LM uses it. It deals documents in groups until every rank's work (its
  estimate: L² / k) is within 5 % of the others', then starts a new group; ranks meet at a
  barrier between groups. Its loops visit every rank for every document.
- `gridwright`: longest-processing-time-first over the whole batch in one group, by the
  plan's FLOPs (the dense part grows with L, attention with L²). Documents go in order of
  decreasing cost, each to the aligned block of k ranks whose busiest rank has the least
  work (numpy over the blocks for k > 1, a heap for k = 1). No barriers are needed: every
  document shared by several ranks is placed in one global order (a larger k means a
  longer, costlier document, so it comes first), and each rank runs its shared documents in
  that order, so collectives meet in the same order on every member.

Both return a `Schedule`; the estimated load uses the same cost for both, so their
balance compares. Imports numpy (and, for `megatron`, Megatron-Core) only.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from math import ceil, log2
from typing import Callable

import numpy as np


@dataclass
class Schedule:
    """One global batch dealt out: `work[g][r]` are the document ids rank r runs in group g
    (ranks meet at a barrier between groups); `cp_size[i]` is document i's CP size."""

    work: list[list[list[int]]]
    cp_size: dict[int, int]
    seconds: float  # time the scheduler took
    estimated_load: list[float] = field(default_factory=list)  # per rank: sum of cost / CP size

    @property
    def imbalance(self) -> float:
        """max / mean of the estimated per-rank work (1.0 is perfect balance)."""
        mean = sum(self.estimated_load) / len(self.estimated_load)
        return max(self.estimated_load) / mean if mean else 1.0


def attention_cost(length: int) -> float:
    """Megatron-Core's workload estimate of a document: length² (`get_total_workload`)."""
    return float(length) * length


def flops_cost(dense_per_token: float, per_context_token: float) -> Callable[[int], float]:
    """A document's training FLOPs: each token's dense FLOPs plus attention over its context
    (the plan's numbers: model_math)."""
    return lambda length: length * (dense_per_token + per_context_token * length)


def cp_size_for(length: int, max_seqlen_per_rank: int, ranks: int) -> int:
    """The next power of two of length / max_seqlen_per_rank (Megatron-Core's
    `BalancedCPScheduler.gpus_needed`), at most every rank."""
    return min(ranks, max(1, 2 ** ceil(log2(length / max_seqlen_per_rank))))


class MegatronScheduler:
    """Megatron-Core's BalancedCPScheduler for `ranks` DP ranks (it asks its group for the
    size only, so a simulation passes a number)."""

    def __init__(self, max_seqlen_per_rank: int, ranks: int, cost: Callable[[int], float] = attention_cost):
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

        class _Size:
            def size(self):
                return ranks

        self.upstream = BalancedCPScheduler(max_seqlen_per_rank, _Size())
        self.max_seqlen, self.ranks, self.cost = max_seqlen_per_rank, ranks, cost

    def schedule(self, lengths: list[int]) -> Schedule:
        started = time.perf_counter()
        _groups, work = self.upstream.get_groups_and_subsamples(list(enumerate(lengths)), None)
        seconds = time.perf_counter() - started
        cp_size: dict[int, int] = {}
        for group in work:
            holders: dict[int, int] = {}
            for rank_ids in group:
                for i in rank_ids:
                    holders[i] = holders.get(i, 0) + 1
            for i, n in holders.items():
                if i in cp_size:
                    raise RuntimeError(f"document {i} is scheduled in more than one group")
                cp_size[i] = n
        load = [0.0] * self.ranks
        for group in work:
            for r, rank_ids in enumerate(group):
                load[r] += sum(self.cost(lengths[i]) / cp_size[i] for i in rank_ids)
        return Schedule(work, cp_size, seconds, load)


class GridwrightScheduler:
    """Longest-processing-time first over aligned blocks, in one group (module docstring)."""

    def __init__(self, max_seqlen_per_rank: int, ranks: int, cost: Callable[[int], float] = attention_cost):
        self.max_seqlen, self.ranks, self.cost = max_seqlen_per_rank, ranks, cost

    def schedule(self, lengths: list[int]) -> Schedule:
        started = time.perf_counter()
        n = self.ranks
        costs = [self.cost(length) for length in lengths]
        order = sorted(range(len(lengths)), key=lambda i: (-costs[i], i))
        cp_size = {i: cp_size_for(lengths[i], self.max_seqlen, n) for i in order}
        loads = np.zeros(n)
        work: list[list[int]] = [[] for _ in range(n)]
        singles = []
        for i in order:
            k = cp_size[i]
            if k == 1:
                singles.append(i)  # costlier documents are all placed by now (see the module docstring)
                continue
            j = int(np.argmin(loads.reshape(n // k, k).max(axis=1)))
            loads[j * k:(j + 1) * k] += costs[i] / k
            for r in range(j * k, (j + 1) * k):
                work[r].append(i)
        heap = [(float(load), r) for r, load in enumerate(loads)]
        heapq.heapify(heap)
        for i in singles:
            load, r = heapq.heappop(heap)
            work[r].append(i)
            heapq.heappush(heap, (load + costs[i], r))
        final = [0.0] * n
        for load, r in heap:
            final[r] = load
        return Schedule([work], cp_size, time.perf_counter() - started, final)


SCHEDULERS = {"megatron": MegatronScheduler, "gridwright": GridwrightScheduler}


def make_scheduler(name: str, max_seqlen_per_rank: int, ranks: int, cost: Callable[[int], float] = attention_cost):
    return SCHEDULERS[name](max_seqlen_per_rank, ranks, cost)


def aligned(work: list[list[list[int]]], cp_size: dict[int, int]) -> bool:
    """Whether every document of size k runs on ranks [j·k, (j+1)·k): the hybrid groups
    Megatron-Core builds (parallel_state.create_hybrid_dp_cp_groups), the only ones a
    document can use."""
    for group in work:
        holders: dict[int, list[int]] = {}
        for r, rank_ids in enumerate(group):
            for i in rank_ids:
                holders.setdefault(i, []).append(r)
        for i, rs in holders.items():
            k = cp_size[i]
            if rs != list(range(rs[0], rs[0] + k)) or rs[0] % k:
                return False
    return True
