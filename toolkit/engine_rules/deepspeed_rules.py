"""The DeepSpeed engine's rules: what it refuses before anything starts, with the upstream
reason where the limit is DeepSpeed's, what a checkpoint's optimizer state is shaped by,
and what each ZeRO stage shards. Torch-free (validation and planning import it); see
`protocol`.

What runs: ZeRO 0-3 and CPU offload over plain data parallelism on a Hugging Face model
(every family gridwright declares), or ZeRO-1/2 on Megatron-Core's GPTModel, the Megatron
engine's very model (`engine.deepspeed_model=megatron`; `auto` picks it with
`parallel.tp>1`, with or without SP), through DeepSpeed's mpu interface.
"""
from __future__ import annotations

import json
from pathlib import Path

from .protocol import Capabilities, StateSharding
from .zero_settings import resolved_zero_settings, zero_settings_problems

NAME = "deepspeed"
MODELS = ("auto", "huggingface", "megatron")  # engine.deepspeed_model
TRAINER_MODULE = "deepspeed_engine"
# DeepSpeed keeps gradients in the params dtype; gridwright's α-β model covers the
# Megatron engine's collectives only (DeepSpeed's buckets and prefetch are its own).
CAPABILITIES = Capabilities(models_communication=False, grads_reduced_in_fp32=False,
                            megatron_torch_native_paths=False)


def measured_recipes(cfg, layout) -> list:
    """No recipe was measured faster on this engine (see `protocol`)."""
    return []


def state_sharding(zero) -> StateSharding:
    """ZeRO as its paper defines it: stage 1 the optimizer state, 2 the gradients too, 3 the
    weights too."""
    return StateSharding(optimizer=zero.stage >= 1, gradients=zero.stage >= 2, weights=zero.stage >= 3)


def builds_megatron_model(engine, parallel) -> bool:
    """Whether DeepSpeed trains Megatron-Core's GPTModel (else the Hugging Face model)."""
    choice = engine.deepspeed_model
    return choice == "megatron" or (choice == "auto" and parallel.tp > 1)


def builds_megatron_layer_spec(engine, parallel) -> bool:
    """Megatron-Core's layer spec only on its GPTModel; the Hugging Face model never uses
    Transformer Engine, whatever is installed."""
    return builds_megatron_model(engine, parallel)


def cuda_device_max_connections(engine, parallel) -> int:
    """ZeRO reduces gradients (overlap_comm) and ZeRO-3 gathers parameters on side streams
    that one hardware queue would serialise behind compute: CUDA's default of 8. Over
    Megatron-Core TP the model is Megatron's, whose SP communication is ordered on one."""
    return 1 if parallel.tp > 1 else 8


def zero_settings(zero, cluster) -> dict:
    """The ZeRO settings this run uses, as the plan records them (null keys resolved)."""
    return resolved_zero_settings(zero, cluster)


def problems(cfg, layout, for_launch: bool) -> list[str]:
    """Every refusal of engine=deepspeed. The protocol's whole config: the checks read nearly every group."""
    megatron_model = builds_megatron_model(cfg.engine, cfg.parallel)
    out = (_layout_problems(layout) + _recompute_problems(cfg.train, megatron_model)
           + _zero_problems(cfg.zero, cfg.precision)
           + (_megatron_model_problems(cfg.engine, cfg.zero, cfg.model, cfg.checkpoint, layout) if megatron_model else [])
           + zero_settings_problems(cfg.zero, cfg.cluster, layout)
           + _feature_problems(cfg.engine, cfg.precision, cfg.zero, layout, megatron_model))
    m = cfg.model
    if cfg.engine.deepspeed_model not in MODELS:
        out.append(f"engine.deepspeed_model='{cfg.engine.deepspeed_model}' is not one of {', '.join(MODELS)}.")
    elif cfg.engine.deepspeed_model == "huggingface" and layout.tp > 1:
        out.append(f"engine.deepspeed_model=huggingface with parallel.tp={layout.tp}: the Hugging Face model has no "
                   "tensor-parallel layers here; DeepSpeed over TP trains Megatron-Core's GPTModel. "
                   "Fix: engine.deepspeed_model=auto (or megatron), or parallel.tp=1.")
    if not megatron_model and m.rope_scaling_factor is not None:
        out.append("engine=deepspeed builds a plain Hugging Face model without rope scaling; Llama-3 rope "
                   "scaling needs engine=megatron.")
    if cfg.data.packing:
        out.append("data.packing with engine=deepspeed: packed documents (attention inside each document) are "
                   "built for Megatron-Core's GPTModel only. Fix: engine=megatron.")
    if for_launch and cfg.launcher.name == "local":
        out += _machine_problems(cfg.cluster, cfg.precision, megatron_model)
    return out


def _layout_problems(layout) -> list[str]:
    out = []
    for name in ("cp", "ep"):
        if getattr(layout, name) > 1:
            out.append(f"engine=deepspeed has no {name.upper()} here; parallel.{name}={getattr(layout, name)} "
                       "needs engine=megatron.")
    if layout.pp > 1:
        out.append(
            f"parallel.pp={layout.pp}: pipeline parallelism under DeepSpeed needs its own PipelineModule, which "
            "gridwright does not build, and DeepSpeed refuses ZeRO-2/3 with it ('ZeRO-2 and ZeRO-3 are incompatible "
            "with pipeline parallelism', deepspeed/runtime/pipe/engine.py; deepspeedai/Megatron-DeepSpeed#474). "
            "Fix: engine=megatron.")
    return out


def _recompute_problems(train, megatron_model: bool) -> list[str]:
    if not megatron_model and train.recompute == "selective":
        return ["train.recompute=selective is Megatron-Core's (attention's core only); the Hugging Face model "
                "engine=deepspeed trains recomputes whole layers. Fix: train.recompute=full, or parallel.tp>1 "
                "(Megatron-Core's GPTModel under DeepSpeed), or engine=megatron."]
    return []


def _zero_problems(zero, precision) -> list[str]:
    z, out = zero, []
    if z.offload_params and z.stage != 3:
        out.append(f"zero.offload_params=true needs zero.stage=3 (got {z.stage}): only ZeRO-3 partitions parameters.")
    if z.offload_optimizer and z.stage == 0:
        out.append("zero.offload_optimizer=true needs zero.stage>=1: there are no partitioned optimizer states "
                   "to offload.")
    if z.stage == 0 and precision.params_dtype != "fp32":
        out.append(
            f"zero.stage=0 with precision.params_dtype={precision.params_dtype}: without ZeRO DeepSpeed wraps the "
            "optimizer in its FP16_UnfusedOptimizer, which takes one Adam step with zero gradients at start (the "
            "first real update is then about 0.7 x lr, and weight decay is applied once) and, in fp16, divides "
            "gradients by a loss scale the loss was never multiplied by (measured with deepspeed 0.19.8). "
            "Fix: zero.stage=1, or precision.params_dtype=fp32.")
    return out


def _to_huggingface(engine, layout) -> str:
    """The overrides that make engine=deepspeed train the Hugging Face model again: TP 1,
    and the model choice unpinned where it names Megatron-Core's (nothing already set)."""
    words = ["parallel.tp=1"] if layout.tp > 1 else []
    return " ".join(words + (["engine.deepspeed_model=huggingface"] if engine.deepspeed_model == "megatron" else []))


def _offload_off(zero) -> str:
    """The overrides that turn off the CPU offload that is on (not the one already off)."""
    return " ".join(f"zero.{k}=false" for k in ("offload_optimizer", "offload_params") if zero[k])


def _megatron_model_problems(engine, zero, model, checkpoint, layout) -> list[str]:
    """What Megatron-Core's GPTModel under DeepSpeed does not run: only ZeRO-1/2 were verified."""
    z, out = zero, []
    huggingface = _to_huggingface(engine, layout)
    if layout.tp == 1 and z.stage in (0, 3):
        out.append(f"engine.deepspeed_model=megatron with zero.stage={z.stage}: Megatron-Core's GPTModel runs under "
                   "DeepSpeed's ZeRO-1/2 here (the stages verified against the Megatron engine). "
                   "Fix: zero.stage=1 or 2, or engine.deepspeed_model=huggingface.")
    what = f"parallel.tp={layout.tp}" if layout.tp > 1 else "engine.deepspeed_model=megatron"
    if z.stage == 3 and layout.tp > 1:
        out.append(
            f"parallel.tp={layout.tp} with zero.stage=3: ZeRO-3 partitions whole parameters for data "
            "parallelism and does not compose with Megatron-Core's tensor-parallel layers; DeepSpeed trains "
            "tensor parallelism with ZeRO 0-2 only (deepspeedai/DeepSpeed#6523; its AutoTP documentation, "
            "deepspeedai/DeepSpeed#8167). Fix: zero.stage=1 or 2, or engine=megatron (ZeRO-3 there is "
            "Megatron-FSDP).")
    elif z.stage == 0 and layout.tp > 1:
        out.append(f"parallel.tp={layout.tp} with zero.stage=0: engine=deepspeed runs tensor parallelism under "
                   "ZeRO-1/2 (its optimizer takes the gradient norm over TP shards). Fix: zero.stage=1.")
    if z.offload_optimizer or z.offload_params:
        out.append(f"{what} with CPU offload is not built on engine=deepspeed: DeepSpeed's CPU "
                   "Adam would step Megatron-Core's TP shards outside the mpu-aware gradient norm gridwright "
                   "checks against the Megatron engine, and no run of it was verified. "
                   f"Fix: {_offload_off(z)}, or {huggingface}.")
    if model.num_experts:
        out.append(f"{what} with experts (model.num_experts={model.num_experts}): DeepSpeed "
                   "has no view of Megatron-Core's expert groups through its mpu interface (it would reduce "
                   "expert gradients over the whole data-parallel group). "
                   f"Fix: {huggingface}, or engine=megatron.")
    if checkpoint.save:
        out.append(f"{what}: engine=deepspeed over Megatron-Core's GPTModel saves no checkpoints "
                   "(not built: DeepSpeed's files would hold Megatron-Core's TP shards without the sharded "
                   "metadata either converter reads). Fix: drop checkpoint.save, or engine=megatron.")
    return out


def _feature_problems(engine, precision, zero, layout, megatron_model: bool) -> list[str]:
    """The torch-native paths and FP8: what exists on this engine's two model builds."""
    e, p, out = engine, precision, []
    huggingface = _to_huggingface(engine, layout)
    if e.tp_comm_overlap:
        out.append("engine.tp_comm_overlap=true swaps the Megatron engine's TP linears for gridwright's "
                   "symmetric-memory ones; DeepSpeed over TP trains Megatron-Core's own linears. "
                   "Fix: engine=megatron, or engine.tp_comm_overlap=false.")
    if e.cuda_graphs != "none":
        out.append(f"engine.cuda_graphs={e.cuda_graphs} is Megatron-Core's graph manager, driven by its pipeline "
                   "schedule; DeepSpeed's step runs neither. Fix: engine=megatron, or engine.cuda_graphs=none.")
    if e.fused_kernels and not megatron_model:
        out.append("engine.fused_kernels=true asks for Megatron-Core's fused SwiGLU and cross-entropy; the Hugging Face "
                   "model DeepSpeed trains here has neither. Fix: engine.fused_kernels=null, or "
                   "engine.deepspeed_model=megatron.")
    if e.gradient_accumulation_fusion:
        out.append("engine.gradient_accumulation_fusion=true adds weight gradients into Megatron-Core DDP's fp32 "
                   "buffer, which DeepSpeed's engine does not keep (it reduces and accumulates gradients itself). "
                   "Fix: engine.gradient_accumulation_fusion=null, or engine=megatron.")
    if e.compile_layers and megatron_model:
        out.append("engine.compile_layers=true with Megatron-Core's GPTModel under DeepSpeed would compile Megatron-Core's "
                   "tensor-parallel linears, which did not learn when compiled on GPU (see engine=megatron's "
                   "refusal). Fix: engine.compile_layers=false, or the Hugging Face model "
                   f"({huggingface}).")
    if p.fp8_recipe is not None and zero.stage == 3:
        out.append("FP8 (precision.fp8_recipe) with zero.stage=3: torchao's float8 linears keep a view of the "
                   "whole weight for the backward, which ZeRO-3's release of gathered parameters does not free, "
                   "and no run of it was verified. Fix: zero.stage=1 or 2, or engine=megatron.")
    if e.compile_layers and zero.stage == 3:
        out.append("engine.compile_layers=true with zero.stage=3: ZeRO-3 gathers each parameter in forward hooks "
                   "on every submodule, which torch.compile of a whole layer traces as graph breaks; DeepSpeed's "
                   "route is its own compiler (DeepCompile, engine.compile()), which gridwright does not drive. "
                   "Fix: engine.compile_layers=false, or zero.stage=1 or 2.")
    if p.fp8_recipe is not None:
        if p.fp8_backend == "transformer_engine" or (p.fp8_backend == "auto" and p.fp8_recipe not in ("tensorwise", "rowwise")):
            out.append(f"FP8 recipe '{p.fp8_recipe}' through Transformer Engine needs Transformer Engine's layers; "
                       "engine=deepspeed trains Hugging Face (or Megatron-Core local) linears. "
                       "Fix: precision.fp8_backend=torchao with recipe tensorwise or rowwise, or engine=megatron.")
        if megatron_model:
            out.append("FP8 on engine=deepspeed with Megatron-Core's GPTModel is not built (torchao's float8 linears replace "
                       "the Hugging Face model's; Megatron-Core's TP linears get them on engine=megatron). "
                       f"Fix: {huggingface} (the Hugging Face model), or engine=megatron.")
    return out


def _machine_problems(cluster, precision, megatron_model: bool) -> list[str]:
    from ..runtime.machine_probe import probe
    from ..versions import deepspeed_version, transformers_version

    fences = [deepspeed_version] + ([] if megatron_model else [transformers_version])
    out = [problem for problem in (fence.refusal() for fence in fences) if problem]
    if cluster.device == "cpu" and precision.params_dtype == "fp16" and not probe().cpu_fp16:
        out.append("engine=deepspeed with precision=fp16 on CPU needs fp16 support in oneDNN (AVX512-FP16 or "
                   "AMX-FP16), which this CPU lacks: DeepSpeed's CPU accelerator refuses fp16 here. "
                   "Fix: precision=bf16 or fp32, or engine=megatron.")
    return out


# Checkpoints ----------------------------------------------------------------------
def settings(zero, precision, dp: int) -> dict:
    """What a DeepSpeed checkpoint's optimizer state is shaped by, and so what a resume must
    share with the run that saved it: DeepSpeed stores each data-parallel rank's partition
    of the optimizer state under that rank's number, in the form of that ZeRO stage and
    precision, and offloaded optimizers keep their own state layout."""
    return {"dp": dp, "zero_stage": zero.stage, "params_dtype": precision.params_dtype,
            "offload_optimizer": bool(zero.offload_optimizer), "offload_params": bool(zero.offload_params)}


def resharding(saved: dict, wanted: dict) -> str:
    """How a DeepSpeed checkpoint saved with `saved` settings resumes under `wanted` ones:
    "same" (load as saved), "universal" (only the data-parallel size differs, ZeRO 1-3
    without offload: DeepSpeed's universal checkpoint re-partitions the optimizer state), or
    "refuse" (another stage, precision or offload shapes the state differently; ZeRO-0
    and offloaded optimizers were not verified through the universal form)."""
    diffs = {k for k in wanted if saved.get(k) != wanted[k]}
    if not diffs:
        return "same"
    if diffs == {"dp"} and wanted["zero_stage"] >= 1 and not (wanted["offload_optimizer"] or wanted["offload_params"]):
        return "universal"
    return "refuse"


def settings_problem(root, path, saved: dict, wanted: dict) -> str | None:
    if resharding(saved, wanted) != "refuse":
        return None
    diffs = [f"{k}={v} (checkpoint: {saved.get(k)})" for k, v in wanted.items() if saved.get(k) != v]
    return (f"checkpoint.load={root} ({Path(path).name}) was saved by DeepSpeed with other settings: "
            f"{', '.join(diffs)}. Its optimizer state is partitioned and shaped by them; only the data "
            "parallel size may change (ZeRO 1-3 without offload, through DeepSpeed's universal checkpoint). "
            "Fix: resume with the saving run's ZeRO stage, precision and offload, or convert it to a "
            "Hugging Face folder (deepspeed-to-hf) and start a new run from that.")


def checkpoint_problems(cfg) -> list[str]:
    """`checkpoint.load` is this engine's own checkpoint root (resumed whole), a Hugging
    Face folder (initial weights), or with `parallel.tp>1` a Megatron-Core checkpoint
    (initial weights, e.g. one hf-to-megatron wrote)."""
    from ..checkpoints.checkpoint_dir import checkpoint_to_load, describe_problem, holds_checkpoints, read_common
    from ..planning.layout import ParallelLayout

    ck = cfg.checkpoint
    if not ck.load:
        return []
    if builds_megatron_model(cfg.engine, cfg.parallel):
        problem = describe_problem(ck.load, cfg.model, engine="megatron", trust=ck.trust_pickled_code)
        return [f"{problem} (engine=deepspeed on Megatron-Core's GPTModel starts from the weights of a Megatron-Core "
                "checkpoint, such as hf-to-megatron writes.)"] if problem else []
    if not holds_checkpoints(ck.load):
        return initial_hf_weights_problems(ck.load, cfg.model)
    if ck.weights_only:
        return [f"checkpoint.weights_only=true: engine=deepspeed resumes its checkpoints whole. To start a new "
                f"run from the weights of {ck.load}, convert them to a Hugging Face folder (python -m "
                f"gridwright.adapters.convert deepspeed-to-hf --deepspeed {ck.load} --out DIR) and load that."]
    if cfg.launcher.name != "local":
        return []
    problem = describe_problem(ck.load, cfg.model, fallback=ck.fallback, engine=NAME, trust=ck.trust_pickled_code)
    if problem:
        return [problem]
    path = checkpoint_to_load(ck.load, ck.fallback, ck.trust_pickled_code)
    problem = settings_problem(ck.load, path, read_common(path).get("settings", {}),
                               settings(cfg.zero, cfg.precision, ParallelLayout.from_config(cfg).dp))
    return [problem] if problem else []


def initial_hf_weights_problems(hf_dir: str, model_cfg) -> list[str]:
    """engine=deepspeed starts from a Hugging Face folder's weights (checkpoint.load, when
    it is not a checkpoint root to resume): it must be one, of this model's shape."""
    from ..checkpoints.checkpoint_dir import model_differences
    from ..families.declaration import UnsupportedModel
    from ..families.hf_config import model_config_from_hf, read_hf_config

    try:
        recorded = model_config_from_hf(read_hf_config(hf_dir), model_cfg.name)
    except UnsupportedModel as e:
        return [f"checkpoint.load={hf_dir}: engine=deepspeed resumes its own checkpoints (a root with '"
                f"latest') or starts from a Hugging Face folder; {e}"]
    except (OSError, json.JSONDecodeError) as e:
        return [f"checkpoint.load={hf_dir}: cannot read its config.json ({e})."]
    diffs = model_differences(recorded, model_cfg)
    if diffs:
        return [f"checkpoint.load={hf_dir} holds another model shape: {', '.join(diffs)}."]
    return []
