"""The DeepSpeed engine: a Hugging Face Llama/Mixtral trained with ZeRO data parallelism.

DeepSpeed here means ZeRO stages 0-3 and CPU offload over plain data parallelism, or
ZeRO-1/2 over Megatron-Core's tensor parallelism (`deepspeed_tensor_parallel`); PP, CP and
EP are the Megatron engine's (validation refuses them here, with the reason). The
data stream, loss definition and metrics are the Megatron engine's, and so are the
optimizer settings, parameter groups and schedule (`optimizer_schedule`) and the rules
that draw the initial weights: from the same weights (`checkpoint.load`, a Hugging Face
folder) a dense model's loss follows the Megatron engine's step by step (tests).
Mixtral adds Megatron-Core's load-balancing loss, computed by its own functions.
Checkpoints (`checkpoint.save`, resume from `checkpoint.load` or a restarted job) are
`deepspeed_checkpoint`'s.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from ..checkpoint_dir import holds_checkpoints
from ..data_source import SyntheticSource
from ..layout import ParallelLayout
from ..heartbeat import NO_PROGRESS
from ..step_metrics import timed_step, write_memory_record
from .deepspeed_config import deepspeed_config
from .hf_model import causal_lm_loss, hf_config, initialise_as_megatron, load_hf_model
from .optimizer_schedule import lr_scheduler, optimizer_config, param_groups
from .timeouts import collective_timeout


def extensions_to_build(cfg) -> list[str]:
    """DeepSpeed's C++ ops this run will compile on first use (DS_BUILD_OPS=0 installs build
    them just in time: minutes on a small machine, once; torch caches them afterwards)."""
    names = (["deepspeed_shm_comm"] if cfg.cluster.device == "cpu" else []) + (
        ["cpu_adam"] if cfg.zero.offload_optimizer else [])
    # torch's own rule for where a JIT extension is cached; a private function, used
    # rather than re-deriving the directory name (it depends on the Python and CUDA build).
    from torch.utils.cpp_extension import _get_build_directory

    try:  # ops built into the install (DS_BUILD_CPU_ADAM=1 ...) are never compiled at run time
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    out = []
    for name in names:
        if installed_ops.get(name):
            continue
        try:
            built = os.path.exists(os.path.join(_get_build_directory(name, False), f"{name}.so"))
        except Exception:  # noqa: BLE001 - unknown: announce rather than stay silent
            built = False
        if not built:
            out.append(name)
    return out


class DeepSpeedTrainer:
    spec_name = "huggingface"
    resumes_checkpoints = True  # checkpoint.load: its own checkpoint root, or a Hugging Face folder

    def __init__(self, cfg, layout: ParallelLayout):
        import deepspeed
        import transformers

        self.cfg, self.layout = cfg, layout
        on_cpu = cfg.cluster.device == "cpu"
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if not on_cpu:
            torch.cuda.set_device(self.device)
        backend = "gloo" if on_cpu else "nccl"
        deepspeed.init_distributed(dist_backend=backend, timeout=collective_timeout(cfg, backend))
        torch.manual_seed(cfg.train.seed)
        if cfg.checkpoint.load and not holds_checkpoints(cfg.checkpoint.load):  # a Hugging Face folder: initial weights
            model = load_hf_model(cfg.checkpoint.load, hf_config(cfg.model))
        else:
            model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
            initialise_as_megatron(model, cfg, layout)
        from .deepspeed_checkpoint import resumes_through_universal

        if cfg.train.recompute == "full":  # every layer's activations recomputed in the backward, as Megatron's "full"
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if model.is_gradient_checkpointing:  # read back from the model: what the summary reports is what runs
            self.spec_name = "huggingface+recompute"
        ds_cfg = deepspeed_config(cfg, layout, load_universal=resumes_through_universal(cfg, layout.dp))
        opt = optimizer_config(cfg)
        groups = param_groups(model, opt)
        optimizer = None
        if "optimizer" not in ds_cfg:
            optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                                          eps=opt.adam_eps, weight_decay=opt.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_cfg, model_parameters=groups
        )
        self.scheduler = lr_scheduler(cfg, self.optimizer)
        self.num_micro = ds_cfg["gradient_accumulation_steps"]
        self.data = SyntheticSource(cfg)
        self.is_logging_rank = dist.get_rank() == 0

    def observed_coordinates(self) -> dict:
        """The data-parallel group DeepSpeed reduces gradients over (read from the engine);
        every other dimension is this rank alone (pure data parallelism)."""
        r = dist.get_rank()
        dp = dist.get_process_group_ranks(self.engine.seq_data_parallel_group)
        groups = {k: [r] for k in ("tp", "pp", "cp", "ep", "etp")}
        groups.update(dp=dp, edp=dp)
        return {"rank": r, "tp": 0, "pp": 0, "dp": dp.index(r), "cp": 0, "ep": 0, "etp": 0, "edp": dp.index(r),
                "groups": groups}

    def train_step(self, step: int) -> dict:
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this update uses
        skipped_before = self.engine.skipped_steps
        total, grad_norm = torch.zeros(1, device=self.device), None
        for batch in self.data.batches("train", step, dist.get_rank(), self.layout.dp, self.num_micro, self.device):
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
        skipped = self.engine.skipped_steps > skipped_before  # fp16 overflow
        if not skipped:
            self.scheduler.step(increment=1)
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        return {"loss": float(total.item()), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_skipped": 1.0 if skipped else 0.0}


def run_training(cfg, layout: ParallelLayout, on_step, on_start=None, job_dir=None, stop=None, progress=None) -> None:
    """Train `cfg.train.steps` steps; `on_step(step, metrics)` runs on the logging rank.
    Every rank leaves its peak memory in `job_dir`. A signal (`stop`) ends training after
    the step every rank is at, saving a checkpoint first when `checkpoint.save` is set.
    With `parallel.tp>1` the model is Megatron-Core's (deepspeed_tensor_parallel).
    `progress` (a Heartbeat) hears of every step and phase on every rank."""
    progress = progress or NO_PROGRESS
    pending = extensions_to_build(cfg)
    if pending and os.environ.get("RANK", "0") == "0":
        print(f"deepspeed   compiling {', '.join(pending)} on first use (several minutes on a small machine, "
              "once; cached by torch afterwards)", flush=True)
    if layout.tp == 1:
        _train(cfg, layout, DeepSpeedTrainer(cfg, layout), on_step, on_start, job_dir, stop, progress)
        dist.destroy_process_group()
        return
    # Megatron-Core's model under DeepSpeed: its CPU workarounds and fixes apply as in its engine.
    from megatron.core import parallel_state as ps

    from .deepspeed_tensor_parallel import DeepSpeedTensorParallelTrainer
    from ..megatron_internals.cpu_compat import cpu_compat
    from ..megatron_internals.fixes import apply_megatron_fixes

    apply_megatron_fixes()
    with cpu_compat() if cfg.cluster.device == "cpu" else contextlib.nullcontext():
        trainer = DeepSpeedTensorParallelTrainer(cfg, layout, deepspeed_config(cfg, layout))
        _train(cfg, layout, trainer, on_step, on_start, job_dir, stop, progress)
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _train(cfg, layout, trainer, on_step, on_start, job_dir, stop, progress) -> None:
    """The training loop around either trainer: resume, steps, saves, an agreed stop."""
    from . import deepspeed_checkpoint

    ck = cfg.checkpoint
    first_step = 0
    if ck.load and holds_checkpoints(ck.load) and trainer.resumes_checkpoints:
        started = time.perf_counter()
        first_step, path = deepspeed_checkpoint.load(trainer, ck.load, job_dir, fallback=ck.fallback)
        if dist.get_rank() == 0:
            print(f"checkpoint  loaded {path} in {time.perf_counter() - started:.1f} s; resuming after step "
                  f"{first_step}", flush=True)
    if on_start is not None:
        on_start(trainer)
    on_cuda = cfg.cluster.device == "cuda"
    for step in range(first_step, cfg.train.steps):
        metrics = timed_step(trainer.train_step, step, on_cuda)
        progress.step_done(step, metrics["step_time_s"])
        if trainer.is_logging_rank:
            on_step(step, metrics)
        done = step + 1
        due = done == cfg.train.steps or (ck.save_interval and done % ck.save_interval == 0)
        signal = stop.agreed(trainer.device) if stop is not None else None
        if ck.save and (due or signal):
            started = time.perf_counter()
            progress.phase("saving")
            path = deepspeed_checkpoint.save(trainer, done, ck.save)
            progress.phase("training")
            if dist.get_rank() == 0:
                print(f"checkpoint  saved {path} in {time.perf_counter() - started:.1f} s", flush=True)
        if signal:
            if dist.get_rank() == 0:
                print(f"stopped     by signal {signal} after step {step}"
                      + ("" if ck.save else " (no checkpoint: checkpoint.save is not set)"), flush=True)
            break
    progress.phase("finishing")
    if job_dir is not None:  # every rank's peak, as the Megatron engine leaves them
        write_memory_record(job_dir, dist.get_rank(), on_cuda)
    dist.barrier()
