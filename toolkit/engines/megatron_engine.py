"""The Megatron-Core engine: one process of a torchrun job.

The step is Megatron-Core's own: its pipeline schedule runs forward/backward over the
micro-batches, its DDP wrapper reduces gradients, its optimizer (the distributed
optimizer for ZeRO stages 1-2) steps, and its scheduler sets the learning rate.
"""
from __future__ import annotations

import contextlib
import os
from functools import partial

import torch
import torch.distributed as dist

from ..data.data_source import make_source
from ..data.packing import mean_context
from ..planning.layout import ParallelLayout
from . import megatron_checkpoint
from ..megatron_internals.cpu_compat import cpu_compat
from ..megatron_internals.fixes import apply_megatron_fixes, reduce_expert_grads_over_expert_dp
from ..megatron_internals.parallel_linear import accumulate_weight_gradients_in_gemm
from ..runtime.machine_probe import transformer_engine_available
from ..config.fp8_choice import transformer_engine_layers
from .megatron_model import (
    build_model_chunks,
    choose_torch_native_paths,
    compile_layers,
    spec_name,
    transformer_config_kwargs,
)
from .optimizer_schedule import lr_scheduler, optimizer_config, set_adam_form
from ..engine_rules.protocol import Resumed
from .megatron_groups import init_parallel, observed_coordinates
from .timeouts import first_save_bound_s


def _loss_func(loss_mask, output_tensor):
    from megatron.core import parallel_state as ps

    losses = output_tensor.float()
    local_sum = torch.sum(losses.view(-1) * loss_mask.view(-1))
    tokens = loss_mask.sum()
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        # Each CP rank holds part of every sequence: divide by the whole sequence's token
        # count. (The schedule multiplies by CP and DDP averages over DP x CP.)
        dist.all_reduce(tokens, group=ps.get_context_parallel_group())
    loss = local_sum / tokens
    # The schedule divides the returned loss in place by the number of micro-batches;
    # report a copy (scaled so that the mean over CP ranks is the sequence's loss).
    return loss, {"lm loss": loss.detach().clone() * cp}


def _token_loss(loss_mask, output_tensor):
    """Packed data: the sum of this rank's token losses and their count (Megatron-Core's
    per-token form: the schedule sums counts, finalize_model_grads divides by the global
    count), so the loss is per token whatever the packing and the layout."""
    local_sum = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    tokens = loss_mask.sum().to(torch.int)
    return local_sum, tokens, {"lm loss": torch.stack([local_sum.detach(), tokens.detach().float()])}


def _packed_forward_step(data_iterator, model):
    """One THD micro-batch of whole documents (`packing.pack`); under static CP this rank
    keeps chunks r and 2·CP-1-r of every document."""
    from megatron.core import parallel_state as ps

    from .torch_attention import thd_params

    batch = next(data_iterator)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        batch = _documents_on_this_cp_rank(batch, ps.get_context_parallel_rank(), cp)
    params = thd_params(batch["cu_seqlens"], batch["max_seqlen"], batch["tokens"].device,
                        te_layers=getattr(model.config, "gridwright_te_layers", False))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=params)
    return output, partial(_token_loss, batch["loss_mask"])


def _documents_on_this_cp_rank(batch: dict, rank: int, size: int) -> dict:
    """Chunks `rank` and 2·size-1-`rank` of each document (of 2·size equal chunks; `pack`
    padded each to a multiple of 2·size), in document order: the THD layout of
    Megatron-Core's rope (rope_utils._get_thd_freqs_on_this_cp_rank)."""
    bounds = batch["cu_seqlens"].tolist()
    index = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * size)
        for c in (rank, 2 * size - 1 - rank):
            index.extend(range(start + c * chunk, start + (c + 1) * chunk))
    index = torch.tensor(index, device=batch["tokens"].device)
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        out[key] = batch[key][:, index]
    return out


def _forward_step(data_iterator, model):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = get_batch_on_this_cp_rank(next(data_iterator))  # no-op without CP
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


class MegatronTrainer:
    """Builds the model, optimizer and schedule for one rank, then runs training steps."""

    def __init__(self, cfg, layout: ParallelLayout, data_cache_dir):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        self.cfg, self.layout = cfg, layout
        self.on_cpu = cfg.cluster.device == "cpu"
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        t = cfg.train
        torch.manual_seed(t.seed)
        te = transformer_engine_layers(cfg.engine, cfg.precision, cfg.model, (not self.on_cpu) and transformer_engine_available())
        # CUDA graphs need the graph-safe generators (same seeds, same numbers); TE's graph
        # capture accepts only TE's own tracker ("Unsupported RNG states tracker" otherwise).
        graphs = cfg.engine.cuda_graphs != "none"
        te_rng = te and graphs
        model_parallel_cuda_manual_seed(t.seed, inference_rng_tracker=self.on_cpu, use_cudagraphable_rng=graphs,
                                        force_reset_rng=graphs, te_rng_tracker=te_rng)
        self.tcfg = TransformerConfig(**transformer_config_kwargs(cfg, layout, te), use_te_rng_tracker=te_rng)
        self.tcfg.gridwright_te_layers = te  # read where a forward step builds TE's THD parameters
        choose_torch_native_paths(cfg, self.tcfg, te)
        chunks = build_model_chunks(cfg.model, cfg.parallel, self.tcfg, te)
        if cfg.engine.compile_layers:  # torch-native layers only (transformer_engine_layers)
            compile_layers(chunks)
        self.spec_name = spec_name(chunks, self.tcfg, te)
        self.chunks = chunks
        reduce_expert_grads_over_expert_dp(chunks, self.tcfg)  # before DDP and the optimizer
        use_dist_opt = cfg.zero.stage >= 1
        fsdp = cfg.zero.stage == 3  # Megatron-FSDP: parameters, gradients and optimizer sharded
        e = cfg.engine
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=e.overlap_grad_reduce or fsdp,
            overlap_param_gather=e.overlap_param_gather or fsdp,
            align_param_gather=e.overlap_param_gather and len(chunks) > 1,
            use_distributed_optimizer=use_dist_opt,
            bucket_size=e.bucket_size,
            use_megatron_fsdp=fsdp,
            data_parallel_sharding_strategy="optim_grads_params" if fsdp else "no_shard",
        )
        if fsdp:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import (
                FullyShardedDataParallel as DistributedDataParallel,
            )
        self.model = []
        for i, chunk in enumerate(chunks):
            if not self.on_cpu:
                chunk.cuda(torch.cuda.current_device())
            self.model.append(
                DistributedDataParallel(
                    config=self.tcfg, ddp_config=ddp_config, module=chunk,
                    disable_bucketing=i > 0,
                )
            )
        for m in self.model:  # the main_grad buffers now exist; routes nothing without the fusion
            accumulate_weight_gradients_in_gemm(m)
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        # The schedule drives DDP's communication through these hooks (one per chunk).
        single = len(self.model) == 1
        if e.overlap_grad_reduce and not fsdp:
            no_sync = [m.no_sync for m in self.model]
            self.tcfg.no_sync_func = no_sync[0] if single else no_sync
            self.tcfg.grad_sync_func = None if single else [m.start_grad_sync for m in self.model]
        if e.overlap_param_gather and not single and not fsdp:
            self.tcfg.param_sync_func = [m.start_param_sync for m in self.model]
        self.optimizer = get_megatron_optimizer(optimizer_config(cfg), self.model)
        set_adam_form(self.optimizer, e.fused_adam)
        # The schedule multiplies each micro-batch's loss by the optimizer's loss scale through
        # this hook (fp16); the optimizer divides the gradients by it. Unset, fp16 gradients
        # came out 65,536 times too small (bf16 and fp32 have scale 1).
        self.tcfg.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = lr_scheduler(cfg.train, self.optimizer)
        self.num_micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
        self.data = make_source(cfg.data, cfg.train, cfg.model, data_cache_dir,
                                pad_multiple=packing_multiple(layout))
        self.dynamic_cp = None
        if cfg.parallel.cp_mode == "dynamic":
            from .dynamic_cp import DynamicContextParallel

            self.dynamic_cp = DynamicContextParallel(cfg, self.data, self.device)
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_logging_rank = (
            ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )

    def run_facts(self) -> dict:
        if self.tcfg.cuda_graph_impl != "local":
            return {}
        from .megatron_model import captured_graphs

        return {"cuda_graphs": {"scope": "layers", "captured": captured_graphs(self.chunks)}}

    def observed_coordinates(self) -> dict:
        return observed_coordinates()

    def _run_schedule(self, split: str, index: int, forward_only: bool) -> list:
        """Megatron-Core's pipeline schedule over one global batch of `split`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = self.cfg.train
        iterators = [
            self.data.batches(split, index, self.dp_rank, self.layout.dp, self.num_micro, self.device)
            for _ in self.model
        ]
        return get_forward_backward_func()(
            forward_step_func=_packed_forward_step if self.cfg.data.packing else _forward_step,
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=self.num_micro,
            seq_length=t.seq_length,
            micro_batch_size=t.micro_batch_size,
            decoder_seq_length=t.seq_length,
            forward_only=forward_only,
        )

    def _run_dynamic(self, split: str, index: int, forward_only: bool) -> tuple[list, dict]:
        """Dynamic CP over one global batch (dynamic_cp), then the gradient reduction the
        schedule would do: over every rank, divided by the global token count."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        result = self.dynamic_cp.run(self.model[0], self.tcfg, split, index, forward_only)
        if not forward_only:
            finalize_model_grads(self.model, num_tokens=result["tokens"].clone())
        losses = [{"lm loss": torch.stack([result["loss_sum"], result["tokens"].float()])}]
        return losses, self.dynamic_cp.step_facts(result)

    def _mean_loss(self, losses: list) -> float:
        """Mean over micro-batches and DP (x CP) ranks, as every rank sees it; per token
        with packed data."""
        from megatron.core import parallel_state as ps

        if self.cfg.data.packing:
            total = torch.zeros(2, device=self.device)  # loss sum, tokens
            if ps.is_pipeline_last_stage(ignore_virtual=True) and losses:
                total += torch.stack([x["lm loss"] for x in losses]).sum(0)
            dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
            return float(total[0] / total[1])
        loss = torch.zeros(1, device=self.device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss += torch.stack([x["lm loss"] for x in losses]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
            loss /= ps.get_data_parallel_world_size(with_context_parallel=True)
        return float(loss.item())

    def train_step(self, step: int) -> dict:
        """One global batch: forward/backward over all micro-batches, then one update."""
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        facts = {}
        if self.dynamic_cp is not None:
            losses, facts = self._run_dynamic("train", step, forward_only=False)
        else:
            losses = self._run_schedule("train", step, forward_only=False)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this update uses
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        if self.cfg.data.packing and self.is_logging_rank and "attention_context" not in facts:
            # the step's FLOPs (step_metrics); dynamic CP reports it from the documents it ran
            facts["attention_context"] = mean_context(len(d) for d in self.data.global_documents("train", step))
        return {
            **facts,
            "loss": self._mean_loss(losses),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_skipped": 0.0 if updated else 1.0,
        }

    @torch.no_grad()
    def evaluate(self, round_index: int) -> float:
        """Validation loss over `data.eval_iters` held-out global batches."""
        for m in self.model:
            m.eval()
        iters = self.cfg.data.eval_iters
        run = ((lambda i: self._run_dynamic("valid", i, forward_only=True)[0]) if self.dynamic_cp is not None
               else (lambda i: self._run_schedule("valid", i, forward_only=True)))
        total = sum(self._mean_loss(run(round_index * iters + i)) for i in range(iters))
        for m in self.model:
            m.train()
        return total / iters

    def load(self, job_dir) -> Resumed:
        ck = self.cfg.checkpoint
        first_step, path, schedule_change = megatron_checkpoint.load(self, ck.load, weights_only=ck.weights_only,
                                                                     fallback=ck.fallback)
        what = f"resuming after step {first_step}" if first_step else "weights only: training starts at step 0"
        return Resumed(first_step, path, what, schedule_change)

    def save(self, step: int, root, background=None):
        return megatron_checkpoint.save(self, step, root, background)


def packing_multiple(layout: ParallelLayout) -> int:
    """What each packed document is padded to a multiple of: 2·CP (static CP cuts it into
    2·CP chunks), times TP under sequence parallelism (which splits the tokens over TP)."""
    return (2 * layout.cp if layout.cp > 1 else 1) * (layout.tp if layout.sp else 1)


@contextlib.contextmanager
def open_trainer(cfg, layout: ParallelLayout, job_dir):
    """Process groups, Megatron-Core's fixes (and CPU workarounds), then one rank's trainer;
    the groups are destroyed when the loop is done."""
    from megatron.core import parallel_state as ps

    apply_megatron_fixes()
    with cpu_compat() if cfg.cluster.device == "cpu" else contextlib.nullcontext():
        init_parallel(cfg.cluster, cfg.watchdog, layout, hybrid_cp=cfg.parallel.cp_mode == "dynamic",
                      longest_bound_s=first_save_bound_s(cfg))
        yield MegatronTrainer(cfg, layout, data_cache_dir=os.path.join(job_dir or ".", "data_cache"))
        ps.destroy_model_parallel()
        if cfg.engine.cuda_graphs != "none":
            # On 2 x H200 (torch 2.11) destroy_process_group hung after the last step of every
            # run whose graphs captured NCCL work (TP=2+SP, CP=2; a faulthandler dump), so the
            # groups are left to the process's exit, which the worker makes without running
            # destructors (process_tree.exit_at_once).
            torch.cuda.synchronize()
            return
        dist.destroy_process_group()
