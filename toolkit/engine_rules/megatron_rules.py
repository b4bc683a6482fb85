"""The Megatron engine's rules: what it refuses before anything starts, and what it shards.
Torch-free (validation and planning import it); see `protocol`."""
from __future__ import annotations

from .protocol import Capabilities, Recipe, StateSharding
from .zero_settings import explicit_deepspeed_only_keys

NAME = "megatron"
TRAINER_MODULE = "megatron_engine"
CAPABILITIES = Capabilities(models_communication=True, grads_reduced_in_fp32=True, megatron_torch_native_paths=True)


# Measured on 2 x H200 (docs/performance.md, "Host-bound layouts"): the host-bound layouts' recipes.
TP_SP_RECIPE = Recipe(
    (("engine.compile_layers", True), ("engine.tp_comm_overlap", True), ("engine.cuda_graphs", "layers")),
    "TP=2+SP of the bench model ran 40.6 % MFU with them against 33.3 % eager, and the Llama-3-8B shape "
    "43.6 % (2 x H200, evaluations/results/bench_gpu_performance_2xh200.md); async TP without "
    "CUDA graphs was slower than eager there", (("tp", 2), ("sp", True), ("pp", 1), ("cp", 1), ("ep", 1)))


def measured_recipes(cfg, layout) -> list[Recipe]:
    """The recipes measured for this layout's kind on GPUs (whether they validate for this
    run is the caller's question)."""
    if cfg.cluster.device != "cuda":
        return []
    out = []
    if layout.tp > 1 and layout.sp:
        out.append(TP_SP_RECIPE)
    return [recipe for recipe in out if recipe.measured_for(layout)]


def state_sharding(zero) -> StateSharding:
    """The distributed optimizer (stages 1 and 2 build the same run) shards the optimizer
    state and fp32 main weights; its gradient buffer stays whole on every rank (the
    reduce-scatter writes each rank's shard in place). Megatron-FSDP (stage 3) shards all."""
    return StateSharding(optimizer=zero.stage >= 1, gradients=zero.stage >= 3, weights=zero.stage >= 3)


def builds_megatron_layer_spec(engine, parallel) -> bool:
    """Megatron-Core's layer spec: Transformer Engine's or torch-native (engine.layer_spec)."""
    return True


def cuda_device_max_connections(engine, parallel) -> int:
    """Megatron-Core orders TP/SP communication before compute on one connection; the
    symmetric-memory overlap (engine.tp_comm_overlap) needs its copy streams to run beside
    compute, which one connection serialises (8 is CUDA's default)."""
    return 8 if engine.tp_comm_overlap else 1


def zero_settings(zero, cluster) -> None:
    """DeepSpeed's ZeRO settings the plan records: none (this engine reads none of them)."""
    return None


# Measured on 1 x H200 (bench_gpu_1xh200_20261129-0815.md and the same bench shape's ZeRO
# rows in -0751, evaluations/results at commit 8871d16): Megatron-FSDP over one data-parallel rank, 8 micro-batches
# a step, ended 14 steps at a mean loss of 10.16 for the last 10, where DeepSpeed ZeRO-1 and
# ZeRO-3 ended at 8.82; with one micro-batch a step it followed the distributed optimizer
# within 0.03. Over two ranks (4 micro-batches each) it learned (2 x H200, 11-27). Cause not
# traced; with one rank there is nothing to shard, so the refusal costs nothing.
FSDP_ONE_RANK_ACCUMULATING = (
    "zero.stage=3 (Megatron-FSDP) over one data-parallel rank with several micro-batches a step did not learn "
    "on GPU (mean loss 10.16 against 8.82 after 14 steps of the bench model, 1 x H200), and one rank has "
    "nothing to shard. Fix: zero.stage=1, or more data-parallel ranks.")


def problems(cfg, layout, for_launch: bool) -> list[str]:
    z, out = cfg.zero, []
    if z.stage == 3 and cfg.cluster.device != "cuda":
        out.append(
            "zero.stage=3 on engine=megatron is Megatron-FSDP, which needs CUDA (it places its "
            "buffers on CUDA devices directly). Fix: zero.stage=1 or 2 on cpu, or engine=deepspeed.")
    if z.stage == 3 and (cfg.checkpoint.save or cfg.checkpoint.load):
        out.append(
            "checkpoints under Megatron-FSDP (zero.stage=3) use another format (fsdp_dtensor) that "
            "gridwright does not write yet. Fix: zero.stage=1 or 2 for checkpointed runs.")
    if z.stage == 3 and layout.dp * layout.cp == 1 and layout.accumulation(cfg.train) > 1:
        out.append(FSDP_ONE_RANK_ACCUMULATING)
    if z.stage == 3 and cfg.engine.gradient_accumulation_fusion:
        out.append(
            "engine.gradient_accumulation_fusion=true with zero.stage=3: Megatron-FSDP takes its own path through "
            "the fused weight-gradient GEMM (into its own gradient buffers), which no run here has verified. "
            "Fix: engine.gradient_accumulation_fusion=null, or zero.stage=1 or 2.")
    if z.offload_optimizer or z.offload_params:
        offload_off = " ".join(f"zero.{k}=false" for k in ("offload_optimizer", "offload_params") if z[k])
        out.append(
            "CPU offload is a DeepSpeed feature here (ZeRO-Offload); engine=megatron has no such mode in "
            f"gridwright. Fix: engine=deepspeed, or {offload_off}.")
    if cfg.engine.overlap_param_gather and z.stage == 0:
        out.append(
            "engine.overlap_param_gather=true needs the distributed optimizer (zero.stage=1 or 2): "
            "without sharding there is no parameter all-gather to overlap. "
            "Fix: zero.stage=1, or engine.overlap_param_gather=false.")
    if cfg.parallel.cp_mode == "dynamic" and (cfg.engine.overlap_grad_reduce or z.stage == 3):
        # Checked on 4 CPU ranks: with the overlap, the gradient norm differed from step 1 on.
        what = ("zero.stage=3 (Megatron-FSDP, whose reduction always overlaps)" if z.stage == 3
                else "engine.overlap_grad_reduce=true")
        out.append(f"parallel.cp_mode=dynamic with {what}: Megatron-Core starts an overlapped gradient "
                   "reduction once every parameter has had as many gradients as on the first step, and under "
                   "dynamic CP a rank runs a different number of forwards each step, so the reduction would "
                   "start too early (wrong gradients) or never. Fix: "
                   f"{'zero.stage=1' if z.stage == 3 else 'engine.overlap_grad_reduce=false'}.")
    out += cuda_graph_problems(cfg)
    keys = explicit_deepspeed_only_keys(z)
    if keys:
        out.append(f"{', '.join(f'zero.{k}' for k in keys)}: DeepSpeed's ZeRO settings, which engine=megatron does "
                   "not read (its buckets are engine.bucket_size, its overlap engine.overlap_grad_reduce and "
                   "engine.overlap_param_gather). Fix: drop them, or engine=deepspeed.")
    return out


def cuda_graph_problems(cfg) -> list[str]:
    """engine.cuda_graphs=layers where Megatron-Core's local graphs cannot capture: a graph
    replays fixed shapes and addresses with no host work inside."""
    if cfg.engine.cuda_graphs == "none":
        return []
    reasons = []
    if cfg.cluster.device != "cuda":
        reasons.append(f"this run is on {cfg.cluster.device} (CUDA graphs are CUDA's)")
    if cfg.data.packing or cfg.parallel.cp_mode == "dynamic":
        reasons.append("packed documents change shape every micro-batch, and their attention reads document "
                       "lengths on the host")
    if cfg.zero.stage == 3:
        reasons.append("Megatron-FSDP gathers parameters in forward pre-hooks, which Megatron-Core's graphs refuse")
    if cfg.model.num_experts:
        reasons.append("MoE layers read token counts back to the host to route (Megatron-Core's dispatchers), "
                       "which a graph cannot hold")
    if cfg.train.recompute != "none":
        # selective: measured on 2 x H200 (Llama-3-8B shape, TP=2+SP), "Checkpointing is not
        # compatible with .grad()" at capture; full: Megatron-Core allows it only whole-iteration.
        reasons.append(f"train.recompute={cfg.train.recompute} recomputes inside the layer, and Megatron-Core's "
                       "backward capture (torch.autograd.grad) cannot run activation checkpointing")
    if not reasons:
        return []
    return [f"engine.cuda_graphs={cfg.engine.cuda_graphs} cannot capture here: {'; '.join(reasons)}. "
            "Fix: engine.cuda_graphs=none."]


def checkpoint_problems(cfg) -> list[str]:
    """Why `checkpoint.load` cannot be resumed (or started from) by this engine."""
    from ..checkpoints.checkpoint_dir import describe_problem

    ck = cfg.checkpoint
    if not ck.load or cfg.launcher.name != "local":
        return []  # another launcher's files live on the cluster; the workers check them
    problem = describe_problem(ck.load, cfg.model, fallback=ck.fallback, engine=NAME, trust=ck.trust_pickled_code)
    return [problem] if problem else []
