"""DeepSpeed ZeRO-1/2 over Megatron-Core tensor parallelism (`engine=deepspeed parallel.tp>1`).

The model is the Megatron engine's GPTModel, built by the same code from the same seed and
TransformerConfig, so it starts from the same weights. DeepSpeed sees Megatron-Core's
process groups through its `mpu` interface (`MegatronCoreGroups`): it partitions the
optimizer state over the data-parallel group, counts tensor-parallel weights once per
shard when it takes the gradient norm (Megatron marks them `tensor_model_parallel`), and
sizes the batch by the data-parallel world. Data, loss, optimizer settings, parameter
groups and schedule are the Megatron engine's; the tests hold the losses to its run of
the same layout.

Sequence parallelism (`parallel.sp=true`) works as in Megatron-Core: each TP rank's norm
weights see only its slice of the sequence, so their gradients are partial sums. Megatron's
`finalize_model_grads` all-reduces them over TP after the backward; DeepSpeed reduces and
partitions gradients inside the backward (its post-accumulate hooks), so here a hook on
each such parameter sums its gradient over TP before it is accumulated
(`sum_partial_gradients_over_tp`).

`checkpoint.load` names a Megatron-Core checkpoint (one hf-to-megatron wrote, or the
Megatron engine's) whose weights the run starts from; this combination saves none.

Not built, refused by validation with the reason: ZeRO-3 (DeepSpeed partitions whole
parameters for data parallelism and does not compose with tensor-parallel layers),
pipeline parallelism, experts, and saving checkpoints.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.data_source import make_source
from ..deepspeed_internals.engine_state import skipped_steps
from ..planning.layout import ParallelLayout
from .deepspeed_evaluation import held_out_loss
from .optimizer_schedule import adamw, lr_scheduler, optimizer_config, param_groups


class MegatronCoreGroups:
    """DeepSpeed's `mpu` interface, answered by Megatron-Core's parallel_state. Pipeline
    parallelism is refused on this engine, so the model-parallel group is the TP group.
    Written out rather than passing `parallel_state` itself: DeepSpeed probes the mpu for
    optional functions (its own sequence parallelism) whose Megatron namesakes mean other
    things."""

    def _ps(self):
        from megatron.core import parallel_state

        return parallel_state

    def get_model_parallel_group(self):
        return self._ps().get_tensor_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return self._ps().get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self._ps().get_tensor_model_parallel_world_size()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self):
        return self._ps().get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self._ps().get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._ps().get_data_parallel_world_size()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def sum_partial_gradients_over_tp(model, config) -> list:
    """Make the gradients Megatron-Core leaves partial on each TP rank whole, as its
    `finalize_model_grads` does: summed for sequence-parallel norm weights (and q/k norms),
    averaged for parameters marked `average_gradients_across_tp_domain`. Each is done by a
    hook that runs before the gradient is accumulated, so DeepSpeed's own hooks, which
    reduce over DP right after accumulation, see the whole gradient. Returns the handles."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return []

    def reducer(op):
        def hook(grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, op=op, group=group)
            return grad
        return hook

    handles = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if getattr(param, "average_gradients_across_tp_domain", False):
            # AVG is not a gloo reduction: sum, then divide.
            size = dist.get_world_size(group)
            handles.append(param.register_hook(lambda g, h=reducer(dist.ReduceOp.SUM): h(g) / size))
        elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            handles.append(param.register_hook(reducer(dist.ReduceOp.SUM)))
    return handles


class DeepSpeedTensorParallelTrainer:
    """One rank of a DeepSpeed ZeRO-1/2 run over a Megatron-Core TP model."""

    def __init__(self, cfg, layout: ParallelLayout, ds_config: dict, data_cache_dir):
        import deepspeed
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        from .megatron_groups import init_parallel
        from .timeouts import first_save_bound_s
        from .megatron_model import build_model_chunks, spec_name, transformer_config_kwargs

        self.cfg, self.layout = cfg, layout
        on_cpu = cfg.cluster.device == "cpu"
        init_parallel(cfg.cluster, cfg.watchdog, layout, longest_bound_s=first_save_bound_s(cfg))
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(cfg.train.seed)
        model_parallel_cuda_manual_seed(cfg.train.seed, inference_rng_tracker=on_cpu)
        tcfg = TransformerConfig(**transformer_config_kwargs(cfg, layout))
        (model,) = build_model_chunks(cfg.model, cfg.parallel, tcfg, False)
        if not on_cpu:
            model.cuda(torch.cuda.current_device())
        if cfg.checkpoint.load:  # initial weights only, before DeepSpeed copies them into its fp32 masters
            from ..checkpoints.checkpoint_dir import checkpoint_to_load
            from .megatron_checkpoint import load_model_weights

            load_model_weights([model], checkpoint_to_load(cfg.checkpoint.load))
        self._tp_gradient_hooks = sum_partial_gradients_over_tp(model, tcfg)
        opt = optimizer_config(cfg)
        groups = param_groups(model, opt)
        optimizer = adamw(groups, opt, cfg.engine.fused_adam)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, model_parameters=groups, mpu=MegatronCoreGroups())
        self.scheduler = lr_scheduler(cfg.train, self.optimizer)
        self.num_micro = ds_config["gradient_accumulation_steps"]
        self.data = make_source(cfg.data, cfg.train, cfg.model, data_cache_dir)
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_logging_rank = ps.get_tensor_model_parallel_rank() == 0 and self.dp_rank == 0
        self.spec_name = spec_name([model], tcfg, te_available=False)

    def run_facts(self) -> dict:
        return {}

    def observed_coordinates(self) -> dict:
        """Megatron-Core's groups, which DeepSpeed was handed and uses."""
        from .megatron_groups import observed_coordinates

        return observed_coordinates()

    def train_step(self, step: int) -> dict:
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped_before = skipped_steps(self.engine)
        total = torch.zeros(1, device=self.device)
        for batch in self.data.batches("train", step, self.dp_rank, self.layout.dp, self.num_micro, self.device):
            loss = self._loss(batch)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach()
        total /= self.num_micro
        from megatron.core import parallel_state as ps

        dist.all_reduce(total, group=ps.get_data_parallel_group())
        total /= self.layout.dp
        skipped = skipped_steps(self.engine) > skipped_before
        if not skipped:
            self.scheduler.step(increment=1)
        grad_norm = self.engine.get_global_grad_norm()
        return {"loss": float(total.item()), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_skipped": 1.0 if skipped else 0.0}

    def _loss(self, batch) -> torch.Tensor:
        """Mean next-token loss over the micro-batch's unmasked tokens (the Megatron engine's)."""
        per_token = self.engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].view(-1).float()
        return torch.sum(per_token.float().view(-1) * mask) / mask.sum()

    def evaluate(self, round_index: int) -> float:
        """Validation loss over `data.eval_iters` held-out global batches."""
        from megatron.core import parallel_state as ps

        return held_out_loss(self, round_index, self._loss, group=ps.get_data_parallel_group())

    def load(self, job_dir) -> None:
        """Nothing to resume: `checkpoint.load`'s weights were read at build."""
        return None

    def save(self, step: int, root):
        raise NotImplementedError("validation refuses checkpoint.save for DeepSpeed over tensor parallelism")
