"""Dynamic context parallelism (`parallel.cp_mode=dynamic`): Megatron-Core's hybrid DP×CP
(ByteScale's hybrid data parallelism, arXiv 2502.21231) driven by gridwright's loop.

Each step, every document of the global batch gets the CP size its length needs (the next
power of two of length / max_seqlen_per_rank), and a scheduler (`cp_schedulers`:
Megatron-Core's BalancedCPScheduler, or gridwright's) deals the documents out to the DP
ranks so that every rank has about the same work. A document with CP size k runs on one
of Megatron-Core's hybrid groups of k ranks
(`initialize_model_parallel(hybrid_context_parallel=True)`), gathering its keys and values
within that group (`torch_attention.context_parallel`).

What gridwright does differently from Megatron-LM's wrapper (`datasets/data_schedule.py`
and `pipeline_parallel/hybrid_cp_schedule.py`):
- the schedule is computed on every rank from the global batch's document lengths, which
  `data_source` derives from the step alone, so no lengths are all-gathered and no sample
  is rerouted by all-to-all: each rank reads the documents it was dealt;
- the loop is gridwright's: Megatron-Core 0.16.1's `hybrid_context_parallel_forward_backward`
  calls `forward_step` without its `cp_group_size` argument (it receives
  `collect_non_loss_data` instead: hybrid_cp_schedule.py, `forward_step(... config,
  collect_non_loss_data, is_first_microbatch=...)` against schedules.py's signature) and
  hard-codes CUDA; driving the documents here also times the swap (scheduling and the
  barriers between groups) and each rank's busy time, which the straggler report needs.

The loss is per token (`calculate_per_token_loss`): each rank sums its tokens' losses, and
`finalize_model_grads` divides the gradients, reduced over every rank, by the global
token count, so the update equals one process's on the same documents.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..data.packing import histogram, mean_context, pack
from ..planning.layout import max_seqlen_per_rank
from .cp_schedulers import aligned, flops_cost, make_scheduler
from .torch_attention import thd_params


def document_cost(model, evaluate):
    """A document's training FLOPs as the plan counts them (model_math, the run's FLOPs
    definition): the cost both schedulers' estimates and gridwright's scheduler use."""
    from ..planning.model_math import model_flops_per_token

    definition = evaluate.flops_definition
    dense = model_flops_per_token(model, 0, definition)
    return flops_cost(dense, model_flops_per_token(model, 1, definition) - dense)


def scheduler_for(cfg, ranks: int):
    """The run's scheduler (parallel.cp_scheduler) over `ranks` DP ranks."""
    per_rank = max_seqlen_per_rank(cfg.parallel, cfg.train.seq_length)
    return make_scheduler(cfg.parallel.cp_scheduler, per_rank, ranks, document_cost(cfg.model, cfg.evaluate))


class DynamicContextParallel:
    """One rank's driver: schedule the global batch, then run the documents this rank was
    dealt, group by group, forward and backward, with a barrier between groups."""

    def __init__(self, cfg, source, device):
        from megatron.core import parallel_state as ps

        self.source, self.device = source, device
        self.group = ps.get_data_parallel_group(with_context_parallel=True)
        self.rank, self.ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.scheduler = scheduler_for(cfg, self.ranks)
        self.max_seqlen = self.scheduler.max_seqlen
        # For k = every rank Megatron-Core hands out the DP group itself; a group of the
        # same members but its own communicator keeps a document's attention apart from the
        # gradient reduction, in the traces too (trace_analysis: "cp<k>").
        self.whole = dist.new_group(dist.get_process_group_ranks(self.group),
                                    group_desc=f"HYBRID_DP_CP_GROUP_{self.ranks}") if self.ranks > 1 else None

    def _cp_group(self, k: int):
        from megatron.core import parallel_state as ps

        if k == 1:
            return None
        return self.whole if k == self.ranks else ps.get_hybrid_data_context_parallel_groups(group_size=k)

    def run(self, model, config, split: str, index: int, forward_only: bool) -> dict:
        """Forward (and backward) over global batch `index`; returns the loss sum and
        token count of this rank's tokens, and the step's schedule facts."""
        docs = self.source.global_documents(split, index)
        plan = self.scheduler.schedule([len(d) for d in docs])
        if not aligned(plan.work, plan.cp_size):
            raise RuntimeError("the scheduler placed a document on ranks that form no hybrid "
                               "CP group (see dynamic_cp.aligned)")
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int, device=self.device)
        busy = barrier = 0.0
        for g, group in enumerate(plan.work):
            started = time.perf_counter()
            mine = group[self.rank]
            # Documents shared with other ranks first, in the schedule's order (their
            # collectives must meet); this rank's own (CP size 1) then go packed together,
            # up to max_seqlen_per_rank tokens per forward, instead of one forward each.
            shared = [[i] for i in mine if plan.cp_size[i] > 1]
            for ids in shared + _bins([i for i in mine if plan.cp_size[i] == 1], docs, self.max_seqlen):
                doc_sum, doc_tokens = self._forward_backward(model, config, [docs[i] for i in ids],
                                                             plan.cp_size[ids[0]], forward_only)
                loss_sum += doc_sum
                tokens += doc_tokens
            busy += _elapsed(started, self.device)  # this rank's work in the group, before it waits
            if g < len(plan.work) - 1:  # every rank ready before CP groups change
                started = time.perf_counter()
                dist.barrier(group=self.group)
                barrier += time.perf_counter() - started
        return {"loss_sum": loss_sum, "tokens": tokens, "plan": plan, "busy_s": busy, "barrier_s": barrier,
                "attention_context": mean_context(len(d) for d in docs)}

    def _forward_backward(self, model, config, docs: list, k: int, forward_only: bool):
        """One forward (and backward) of one document over its CP group of k ranks (sbhd,
        this rank's 2 of 2·k chunks), or of several CP-1 documents packed (THD)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.utils import get_batch_on_this_cp_rank

        cp_group = self._cp_group(k)
        batch = pack(docs, 2 * k if k > 1 else 1, self.device)
        cu, longest = batch["cu_seqlens"], batch["max_seqlen"]
        batch = {key: batch[key] for key in ("tokens", "labels", "loss_mask", "position_ids")}
        if k > 1:
            batch = get_batch_on_this_cp_rank(batch, cp_group=cp_group)
            params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest, local_cp_size=k, cp_group=cp_group)
        else:
            params = thd_params(cu, longest, self.device)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
        mask = batch["loss_mask"]
        doc_sum = torch.sum(losses.float().view(-1) * mask.view(-1))
        if not forward_only:
            (config.grad_scale_func(doc_sum) if config.grad_scale_func else doc_sum).backward()
        return doc_sum.detach(), mask.sum().to(torch.int)

    def step_facts(self, result: dict) -> dict:
        """The step's dynamic-CP record (every rank calls it: one all-gather of busy times)."""
        plan = result["plan"]
        busy = torch.tensor([result["busy_s"]], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(busy) for _ in range(self.ranks)]
        dist.all_gather(every, busy, group=self.group)
        busy_s = [float(b) for b in every]
        mean = sum(busy_s) / len(busy_s)
        sizes = histogram(plan.cp_size.values())
        return {
            "cp_groups": float(len(plan.work)),
            "cp_schedule_ms": plan.seconds * 1e3,
            "cp_barrier_ms": result["barrier_s"] * 1e3,
            "cp_imbalance_estimated": plan.imbalance,
            "attention_context": result["attention_context"],
            "cp_straggler": max(busy_s) / mean if mean else 1.0,
            **{f"cp_size_{k}_documents": float(n) for k, n in sizes.items()},
        }


def _bins(ids: list[int], docs: list, capacity: int) -> list[list[int]]:
    """Consecutive runs of documents of at most `capacity` tokens together (a longer one
    alone), in order."""
    out: list[list[int]] = []
    used = capacity
    for i in ids:
        if used + len(docs[i]) > capacity or not out:
            out.append([])
            used = 0
        out[-1].append(i)
        used += len(docs[i])
    return out


def _elapsed(started: float, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


PREVIEW_STEPS = 20


def preview_lines(cfg, layout, job_dir) -> list[str]:
    """What `launcher=plan` prints for packed data: the documents of the first steps and,
    under dynamic CP, the hybrid groups and the CP sizes the scheduler deals out (the same
    schedule every rank computes while training)."""
    import statistics
    from pathlib import Path

    from ..data.data_source import make_source

    steps = min(cfg.train.steps, PREVIEW_STEPS)
    source = make_source(cfg.data, cfg.train, cfg.model, Path(job_dir) / "data_cache")
    batches = [[len(d) for d in source.global_documents("train", s)] for s in range(steps)]
    every = [n for b in batches for n in b]
    context = mean_context(every)
    lines = [f"documents   steps 0-{steps - 1}: {len(every):,} documents of {min(every):,} to {max(every):,} tokens "
             f"(median {statistics.median(every):,.0f}); mean context {context:,.0f} of {cfg.train.seq_length:,} tokens"]
    if cfg.parallel.cp_mode != "dynamic":
        return lines
    ranks = layout.dp * layout.cp
    scheduler = scheduler_for(cfg, ranks)
    per_rank = scheduler.max_seqlen
    sizes = [2 ** i for i in range(1, ranks.bit_length())]  # Megatron-Core's hybrid groups, and all ranks
    groups = "; ".join(f"of {k}: " + " ".join(str(list(range(j, j + k))) for j in range(0, ranks, k)) for k in sizes)
    lines.append(f"dynamic CP  at most {per_rank:,} tokens of a document per rank; CP groups (DP ranks) {groups or 'none'}")
    plans = [scheduler.schedule(b) for b in batches]
    cp = histogram(k for p in plans for k in p.cp_size.values())
    lines.append("            " + ", ".join(f"CP {k} x {n:,}" for k, n in cp.items())
                 + f" (documents, first {steps} steps); {sum(len(p.work) for p in plans) / steps:.1f} groups/step; "
                 f"estimated imbalance {sum(p.imbalance for p in plans) / steps:.2f} (max/mean per rank, "
                 f"FLOPs); {cfg.parallel.cp_scheduler}'s scheduler "
                 f"{sum(p.seconds for p in plans) / steps * 1e3:.1f} ms/step to schedule")
    return lines
