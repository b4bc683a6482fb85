"""The DeepSpeed engine: a Hugging Face model of any gridwright family trained with ZeRO data parallelism.

DeepSpeed here means ZeRO stages 0-3 and CPU offload over plain data parallelism, or
ZeRO-1/2 over Megatron-Core's tensor parallelism (`deepspeed_tensor_parallel`); PP, CP and
EP are the Megatron engine's (validation refuses them here, with the reason). The
data stream, loss definition and metrics are the Megatron engine's, and so are the
optimizer settings, parameter groups and schedule (`optimizer_schedule`) and the rules
that draw the initial weights: from the same weights (`checkpoint.load`, a Hugging Face
folder) a dense model's loss follows the Megatron engine's step by step (tests).
Mixtures of experts (Mixtral, Qwen3-MoE) add Megatron-Core's load-balancing loss, computed by its own functions.
Checkpoints (`checkpoint.save`, resume from `checkpoint.load` or a restarted job) are
`deepspeed_checkpoint`'s. The loop around the trainers (resume, profiling window,
evaluation, saves, stops, metrics) is every engine's (`training_loop`).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
import torch.distributed as dist

from ..checkpoints.checkpoint_dir import holds_checkpoints
from ..data.data_source import make_source
from ..deepspeed_internals.engine_state import data_parallel_group, skipped_steps
from ..planning.layout import ParallelLayout
from ..versions import transformers_version
from .deepspeed_config import deepspeed_config
from .deepspeed_evaluation import held_out_loss
from ..engine_rules.deepspeed_rules import builds_megatron_model
from ..engine_rules.zero_settings import resolved_zero_settings
from .hf_model import causal_lm_loss, hf_config, initialise_as_megatron, load_hf_model
from .optimizer_schedule import adamw, lr_scheduler, optimizer_config, param_groups
from ..engine_rules.protocol import Resumed
from .timeouts import collective_timeout, first_save_bound_s


def extensions_to_build(cluster, zero) -> list[str]:
    """DeepSpeed's C++ ops this run will compile on first use (DS_BUILD_OPS=0 installs build
    them just in time: minutes on a small machine, once; torch caches them afterwards)."""
    from ..deepspeed_internals.extensions import CPU_ADAM, SHM_COMM, not_yet_built

    return not_yet_built(([SHM_COMM] if cluster.device == "cpu" else []) + ([CPU_ADAM] if zero.offload_optimizer else []))


class DeepSpeedTrainer:
    spec_name = "huggingface"

    def __init__(self, cfg, layout: ParallelLayout, data_cache_dir):
        import deepspeed

        transformers_version.refuse_untested()  # where the job runs, whose transformers may not be the planner's
        import transformers

        self.cfg, self.layout = cfg, layout
        on_cpu = cfg.cluster.device == "cpu"
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if not on_cpu:
            torch.cuda.set_device(self.device)
        backend = "gloo" if on_cpu else "nccl"
        deepspeed.init_distributed(dist_backend=backend, timeout=collective_timeout(cfg.watchdog, backend,
                                                                                        first_save_bound_s(cfg)))
        torch.manual_seed(cfg.train.seed)
        if cfg.checkpoint.load and not holds_checkpoints(cfg.checkpoint.load):  # a Hugging Face folder: initial weights
            model = load_hf_model(cfg.checkpoint.load, hf_config(cfg.model))
        else:
            model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
            initialise_as_megatron(model, cfg, layout)
        from .deepspeed_checkpoint import resumes_through_universal

        if cfg.train.recompute == "full":  # every layer's activations recomputed in the backward, as Megatron's "full"
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if model.is_activation_checkpointing:  # read back from the model: what the summary reports is what runs
            self.spec_name = "huggingface+recompute"
        self.spec_name += torch_native_paths(model, cfg)
        if resolved_zero_settings(cfg.zero, cfg.cluster).get("stage3_leaf_layers"):
            # One fetch and one release per decoder layer rather than per linear: ZeRO-3's
            # hooks run on the host for every module, and the step was host-bound on them.
            from ..deepspeed_internals.engine_state import gather_whole_layers

            gather_whole_layers(model, type(model.model.layers[0]))
            self.spec_name += "+z3_leaf_layers"
        ds_cfg = deepspeed_config(cfg, layout, load_universal=resumes_through_universal(
            cfg.checkpoint, cfg.zero, cfg.precision, layout.dp))
        opt = optimizer_config(cfg)
        groups = param_groups(model, opt)
        optimizer = None
        if "optimizer" not in ds_cfg:
            optimizer = adamw(groups, opt, cfg.engine.fused_adam)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_cfg, model_parameters=groups
        )
        self.scheduler = lr_scheduler(cfg.train, self.optimizer)
        self.num_micro = ds_cfg["gradient_accumulation_steps"]
        self.data = make_source(cfg.data, cfg.train, cfg.model, data_cache_dir)
        self.dp_rank = self.observed_coordinates()["dp"]
        self.is_logging_rank = dist.get_rank() == 0

    def run_facts(self) -> dict:
        return {}

    def observed_coordinates(self) -> dict:
        """The data-parallel group DeepSpeed reduces gradients over (read from the engine);
        every other dimension is this rank alone (pure data parallelism)."""
        r = dist.get_rank()
        dp = dist.get_process_group_ranks(data_parallel_group(self.engine))
        groups = {k: [r] for k in ("tp", "pp", "cp", "ep", "etp")}
        groups.update(dp=dp, edp=dp)
        return {"rank": r, "tp": 0, "pp": 0, "dp": dp.index(r), "cp": 0, "ep": 0, "etp": 0, "edp": dp.index(r),
                "groups": groups}

    def train_step(self, step: int) -> dict:
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this update uses
        skipped_before = skipped_steps(self.engine)
        total, grad_norm = torch.zeros(1, device=self.device), None
        for batch in self.data.batches("train", step, self.dp_rank, self.layout.dp, self.num_micro, self.device):
            loss, objective = causal_lm_loss(self.engine, batch, self.cfg.model)
            self.engine.backward(objective)
            if self.cfg.zero.stage == 0 and self.engine.is_gradient_accumulation_boundary():
                # Without ZeRO DeepSpeed clips but keeps no norm: take it from the reduced
                # gradients before its step clips them (as the Megatron engine reports it).
                grad_norm = torch.nn.utils.get_total_norm(
                    [q.grad for q in self.engine.module.parameters() if q.grad is not None])
            self.engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            total += loss.detach()
        total /= self.num_micro
        dist.all_reduce(total)
        total /= dist.get_world_size()
        skipped = skipped_steps(self.engine) > skipped_before  # fp16 overflow
        if not skipped:
            self.scheduler.step(increment=1)
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        return {"loss": float(total.item()), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_skipped": 1.0 if skipped else 0.0}

    def evaluate(self, round_index: int) -> float:
        """Validation loss: the language-model loss alone, as the Megatron engine reports it."""
        return held_out_loss(self, round_index, lambda batch: causal_lm_loss(self.engine, batch, self.cfg.model)[0])

    def load(self, job_dir) -> Resumed | None:
        """Resume this engine's own checkpoint root (a Hugging Face folder was read at build)."""
        ck = self.cfg.checkpoint
        if not holds_checkpoints(ck.load):
            return None
        from . import deepspeed_checkpoint

        first_step, path, schedule_change = deepspeed_checkpoint.load(self, ck.load, job_dir, fallback=ck.fallback)
        return Resumed(first_step, path, f"resuming after step {first_step}", schedule_change)

    def save(self, step: int, root, background=None):
        from . import deepspeed_checkpoint

        return deepspeed_checkpoint.save(self, step, root, background)


def torch_native_paths(model, cfg) -> str:
    """torchao's float8 linears (precision.fp8_recipe, torchao's tensorwise or rowwise) and
    compiled decoder layers (engine.compile_layers), applied to the Hugging Face model
    before DeepSpeed wraps it; returns what to add to the layer spec's name. The output
    layer stays in bf16 unless precision.fp8_output_layer, as on the Megatron engine."""
    added = ""
    recipe = cfg.precision.fp8_recipe
    if recipe is not None:
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if cfg.cluster.device == "cpu":  # float8 arithmetic emulated (no float8 matmul on CPU)
            config = dataclasses.replace(config, emulate=True)
        output_too = cfg.precision.fp8_output_layer
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda mod, fqn: output_too or fqn != "lm_head")
        added += f"+fp8_{recipe}" + ("+fp8_output_layer" if output_too else "")
    if cfg.engine.compile_layers:
        from ..torch_internals.dynamo import raise_recompile_limit

        layers = model.model.layers
        raise_recompile_limit(len(layers))
        for layer in layers:
            layer.compile()  # in place: parameter names, and so checkpoints, stay as they are
        added += "+compiled"
    return added


@contextlib.contextmanager
def first_start(cluster, zero):
    """Around building the trainer: DeepSpeed's C++ ops compile on first use (minutes, once
    per machine), so rank 0 announces that with an estimate and says how long it took;
    DeepSpeed's own "... built successfully" print, made by every rank at every start, is
    dropped (known_warnings.PRINTED)."""
    from ..deepspeed_internals.extensions import compile_estimate_s
    from ..basics.known_warnings import printed_lines_filtered

    pending = extensions_to_build(cluster, zero)
    announce = bool(pending) and os.environ.get("RANK", "0") == "0"
    if announce:
        busy = max(0.0, os.getloadavg()[0] - 1.0)  # runnable processes besides this one
        estimate = compile_estimate_s(pending, len(os.sched_getaffinity(0)), busy)
        print(f"deepspeed   compiling {', '.join(pending)} on first use, est. {estimate:.0f} s (the compiler time "
              f"measured on 2 CPU cores, at this machine's load {busy + 1:.1f}); once, cached by torch afterwards",
              flush=True)
    started = time.perf_counter()
    progress = compile_progress(pending, estimate) if announce else contextlib.nullcontext()
    with printed_lines_filtered(), progress:
        yield
    if announce:
        print(f"deepspeed   compiled {', '.join(pending)} and started in {time.perf_counter() - started:.0f} s",
              flush=True)


@contextlib.contextmanager
def compile_progress(pending: list[str], estimate_s: float, every_s: float = 30.0):
    """While the ops `pending` compile (no output of their own for minutes), a line every
    `every_s` seconds says the run is still at it, against the estimate. Nothing without
    pending ops."""
    if not pending:
        yield
        return
    done, started = threading.Event(), time.perf_counter()

    def tick():
        while not done.wait(every_s):
            print(f"deepspeed   still compiling {', '.join(pending)}: {time.perf_counter() - started:.0f} s "
                  f"of est. {estimate_s:.0f} s", flush=True)

    ticker = threading.Thread(target=tick, name="compile-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


@contextlib.contextmanager
def open_trainer(cfg, layout: ParallelLayout, job_dir):
    """One rank's DeepSpeed trainer: the Hugging Face model, or Megatron-Core's GPTModel
    (engine.deepspeed_model; deepspeed_tensor_parallel, with Megatron-Core's fixes and CPU
    workarounds as in its own engine); process groups are destroyed at the end."""
    cache = os.path.join(job_dir or ".", "data_cache")
    if not builds_megatron_model(cfg.engine, cfg.parallel):
        with first_start(cfg.cluster, cfg.zero):
            trainer = DeepSpeedTrainer(cfg, layout, cache)
        yield trainer
        dist.destroy_process_group()
        return
    from megatron.core import parallel_state as ps

    from ..megatron_internals.cpu_compat import cpu_compat
    from ..megatron_internals.fixes import apply_megatron_fixes
    from .deepspeed_tensor_parallel import DeepSpeedTensorParallelTrainer

    apply_megatron_fixes()
    with cpu_compat() if cfg.cluster.device == "cpu" else contextlib.nullcontext():
        with first_start(cfg.cluster, cfg.zero):
            trainer = DeepSpeedTensorParallelTrainer(cfg, layout, deepspeed_config(cfg, layout), cache)
        yield trainer
        ps.destroy_model_parallel()
        dist.destroy_process_group()
