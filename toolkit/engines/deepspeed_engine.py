"""The DeepSpeed engine: a Hugging Face Llama/Mixtral trained with ZeRO data parallelism.

DeepSpeed here means ZeRO stages 0-3 and CPU offload over plain data parallelism; model
parallelism is Megatron-Core's job (validation refuses TP/PP/CP/EP on this engine). The
data stream, loss definition and metrics are the Megatron engine's, so runs compare.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data_source import SyntheticSource
from ..layout import ParallelLayout
from ..step_metrics import timed_step, write_memory_record


def hf_config(model):
    """The transformers config of the same shape as gridwright's ModelConfig (the same one
    checkpoint export writes)."""
    from omegaconf import OmegaConf

    from gridwright.adapters.hf_architecture import transformers_config

    return transformers_config(OmegaConf.to_container(model, resolve=True))


def deepspeed_config(cfg, layout: ParallelLayout) -> dict:
    """DeepSpeed's JSON config for this experiment."""
    t, z, p = cfg.train, cfg.zero, cfg.precision
    zero = {"stage": z.stage, "overlap_comm": cfg.cluster.device == "cuda"}
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.cluster.device == "cuda"}
    if z.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cfg.cluster.device == "cuda"}
    out = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * layout.dp),
        "train_batch_size": t.global_batch_size,
        "zero_optimization": zero,
        "bf16": {"enabled": p.params_dtype == "bf16"},
        "fp16": {"enabled": p.params_dtype == "fp16", "initial_scale_power": 16},
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if z.offload_optimizer:
        # ZeRO-Offload refuses a client (torch) optimizer; DeepSpeed's own CPU Adam is used.
        out["optimizer"] = {"type": "AdamW", "params": {"lr": t.lr, "betas": [0.9, 0.95],
                                                         "weight_decay": t.weight_decay}}
    return out


def _lr_at(cfg, step: int) -> float:
    """Linear warm-up then cosine decay to min_lr, matching the Megatron engine's scheduler."""
    import math

    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


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

    def __init__(self, cfg, layout: ParallelLayout):
        import deepspeed
        import transformers

        self.cfg, self.layout = cfg, layout
        on_cpu = cfg.cluster.device == "cpu"
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if not on_cpu:
            torch.cuda.set_device(self.device)
        pending = extensions_to_build(cfg)
        if pending and os.environ.get("RANK", "0") == "0":
            print(f"deepspeed   compiling {', '.join(pending)} on first use (several minutes on a small machine, "
                  "once; cached by torch afterwards)", flush=True)
        deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
        torch.manual_seed(cfg.train.seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
        ds_cfg = deepspeed_config(cfg, layout)
        optimizer = None
        if "optimizer" not in ds_cfg:
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95),
                                          weight_decay=cfg.train.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_cfg, model_parameters=model.parameters()
        )
        self.num_micro = ds_cfg["gradient_accumulation_steps"]
        self.data = SyntheticSource(cfg)
        self.is_logging_rank = dist.get_rank() == 0

    def observed_coordinates(self) -> dict:
        """Pure data parallelism: every other dimension is trivially this rank alone."""
        r, world = dist.get_rank(), dist.get_world_size()
        everyone = list(range(world))
        groups = {k: [r] for k in ("tp", "pp", "cp", "ep", "etp")}
        groups.update(dp=everyone, edp=everyone)
        return {"rank": r, "tp": 0, "pp": 0, "dp": r, "cp": 0, "ep": 0, "etp": 0, "edp": r, "groups": groups}

    def train_step(self, step: int) -> dict:
        lr = _lr_at(self.cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros(1, device=self.device)
        for batch in self.data.batches("train", step, dist.get_rank(), self.layout.dp, self.num_micro, self.device):
            logits = self.engine(input_ids=batch["tokens"]).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch["labels"].view(-1))
            self.engine.backward(loss)
            self.engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            total += loss.detach()
        total /= self.num_micro
        dist.all_reduce(total)
        total /= dist.get_world_size()
        grad_norm = self.engine.get_global_grad_norm()
        return {"loss": float(total.item()), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_skipped": 0.0}


def run_training(cfg, layout: ParallelLayout, on_step, on_start=None, job_dir=None, stop=None) -> None:
    """Train `cfg.train.steps` steps; `on_step(step, metrics)` runs on the logging rank.
    Every rank leaves its peak memory in `job_dir`. A signal (`stop`) ends training after
    the step every rank is at (this engine writes no checkpoints)."""
    trainer = DeepSpeedTrainer(cfg, layout)
    if on_start is not None:
        on_start(trainer)
    on_cuda = cfg.cluster.device == "cuda"
    for step in range(cfg.train.steps):
        metrics = timed_step(trainer.train_step, step, on_cuda)
        if trainer.is_logging_rank:
            on_step(step, metrics)
        if stop is not None and stop.agreed(trainer.device):
            if dist.get_rank() == 0:
                print(f"stopped     by signal {stop.signal} after step {step}", flush=True)
            break
    if job_dir is not None:  # every rank's peak, as the Megatron engine leaves them
        write_memory_record(job_dir, dist.get_rank(), on_cuda)
    dist.barrier()
    dist.destroy_process_group()
