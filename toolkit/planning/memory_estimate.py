"""Per-GPU memory estimate, checked against the GPU's memory before a job starts.

A planning number, not a measurement. Its terms, per rank of the worst pipeline stage:

* states: bytes per parameter for weights, gradients and Adam states under mixed
  precision (ZeRO paper accounting: 16-bit weights 2, gradients 2, fp32 master + m + v
  12; fp32 training: 4 + 4 + 8; the Megatron engine keeps gradients in fp32: 4),
  divided over DP x CP (Megatron-Core's data-parallel group with context parallelism)
  where the engine's rules say its ZeRO stage shards them (`state_sharding`: Megatron's
  distributed optimizer, stage 1 or 2, keeps the whole gradient buffer). Expert
  parameters are divided over EP x expert-TP and their states over expert-DP.
* activations: Korthikanti et al. 2022 (34 s b h bytes per layer with SP, 10 + 24/t
  without, times ACTIVATION_SCALE for the torch-native spec), with fused attention (no s^2 term, so selective recompute saves nothing
  extra); MoE adds the MLP term once per extra routed expert; full recompute keeps
  only each layer's input (2 s b h). The first stage holds up to PP micro-batches
  in flight under 1F1B.
* logits: three fp32 copies of the logits on the last stage (upcast, softmax kept for
  backward, gradient), as Megatron's unfused vocab-parallel cross-entropy holds them.
* the optimizer step's temporary, with engine.fused_adam=false only: torch's foreach Adam
  (Megatron-Core's fallback without Apex or Transformer Engine) allocates sqrt(v) for a
  whole parameter group (fp32) at once; the fused form allocates nothing. Activations are
  freed by then, so the peak is the larger of activations + logits and this temporary. It
  dominates where optimizer states do (MoE: the expert group of a rank is all its experts
  when expert-DP is 1): measured on 2 x H200, Mixtral width EP=2 (foreach) peaked 9 % above
  the estimate without this term.
* a fixed workspace for the CUDA context, communicator buffers and fragmentation.

A CPU run keeps the same terms in host memory, one set per process, with the Python
runtime (torch and Megatron-Core imported) in place of the CUDA workspace:
`host_memory_estimate`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .layout import ParallelLayout, max_seqlen_per_rank
from .model_math import ParamCounts, param_counts

GIB = 1024**3
WORKSPACE_GIB = 3.0
# Korthikanti's constants describe GeLU layers with fused kernels. The torch-native layer
# spec that runs without Transformer Engine (SwiGLU, SDPA, rotary copies) keeps more:
# 42/34 of them, measured on 2 x H100 (evaluations/results/eval_sweep_*.md: 1 GPU, DP=2,
# TP=2+SP and CP=2 all gave 1.24 x the formula's per-layer bytes).
ACTIVATION_SCALE = 42 / 34
# One CPU worker's own footprint before its model: importing torch and Megatron-Core took
# 0.34 GiB of resident memory on the 2-core CPU machine; rounded up for gloo and the run's buffers.
CPU_PROCESS_GIB = 0.5


@dataclass(frozen=True)
class MemoryEstimate:
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    optimizer_step_gib: float = 0.0  # the optimizer step's temporary (not live with activations)
    workspace_gib: float = WORKSPACE_GIB

    @property
    def total_gib(self) -> float:
        transient = max(self.activations_gib + self.logits_gib, self.optimizer_step_gib)
        return self.weights_gib + self.grads_gib + self.optimizer_gib + transient + self.workspace_gib

    def describe(self) -> str:
        transient = f"activations {self.activations_gib:.1f} + logits {self.logits_gib:.1f}"
        if self.optimizer_step_gib > self.activations_gib + self.logits_gib:
            transient = f"optimizer-step temporary {self.optimizer_step_gib:.1f} (> {transient})"
        return (
            f"{self.total_gib:.1f} GiB = weights {self.weights_gib:.1f} + grads {self.grads_gib:.1f}"
            f" + optimizer {self.optimizer_gib:.1f} + {transient} + workspace {self.workspace_gib:.1f}"
        )


def _state_bytes(params: float, dp: int, zero, sharding, sixteen_bit: bool,
                 fp32_grads: bool) -> tuple[float, float, float]:
    """Bytes of weights, gradients and optimizer state for `params` parameters, divided
    over `dp` ranks where the engine's `sharding` (protocol.StateSharding) shards them."""
    w = 2.0 if sixteen_bit else 4.0
    g = 4.0 if fp32_grads else w
    o = 12.0 if sixteen_bit else 8.0
    if sharding.optimizer:
        o /= dp
    if sharding.gradients:
        g /= dp
    if sharding.weights:
        w /= dp
    if zero.offload_optimizer:
        o = 0.0
    if zero.offload_params:
        w = 0.0
    return params * w, params * g, params * o


def estimate_memory(cfg, layout: ParallelLayout, engine, params: ParamCounts | None = None) -> MemoryEstimate:
    """`engine`: the engine's rules (`engine_rules.registry.rules(cfg.engine)`), handed in so
    that planning never imports an engine; `params`: the model's parameter counts where the
    caller has them (a plan does)."""
    m, t = cfg.model, cfg.train
    pc = params or param_counts(m)
    tp, pp = layout.tp, layout.pp
    layers = m.num_layers // pp
    sixteen_bit = cfg.precision.params_dtype in ("bf16", "fp16")
    fp32_grads = engine.CAPABILITIES.grads_reduced_in_fp32
    sharding = engine.state_sharding(cfg.zero)
    act_bytes = 2.0 if sixteen_bit else 4.0

    dense_layer = layers * pc.per_layer_dense / tp
    expert_layer = layers * pc.expert_per_layer / (layout.ep * layout.etp)
    first_extra = pc.embedding / tp
    last_extra = pc.output / tp

    s = t.seq_length / layout.cp
    b, h = t.micro_batch_size, m.hidden_size
    if cfg.parallel.cp_mode == "dynamic":  # a forward holds at most this many tokens of documents
        s, b = max_seqlen_per_rank(cfg.parallel, t.seq_length), 1
    sbh = s * b * h * act_bytes / 2.0  # the paper's constants assume 2-byte activations
    full_layer = 34 * sbh / tp if layout.sp else sbh * (10 + 24 / tp)
    if m.num_experts:
        full_layer += (m.moe_router_topk - 1) * 19 * sbh / tp
    full_layer *= ACTIVATION_SCALE
    # Full recompute keeps each layer's input, plus one layer's activations while it is
    # recomputed for backward.
    per_layer = 2 * sbh / (tp if layout.sp else 1) if t.recompute == "full" else full_layer
    recompute_live = full_layer if t.recompute == "full" else 0.0
    accumulation = max(1, layout.accumulation(t))
    in_flight = min(pp, accumulation)
    if layout.vpp:
        in_flight *= 1 + (pp - 1) / (pp * layout.vpp)
    # Megatron's unfused cross-entropy: the fp32 upcast of the logits, its softmax kept for
    # backward, and the logits' fp32 gradient.
    logits = 3 * s * b * m.vocab_size * 4 / tp

    if pp == 1:
        stages = [(first_extra + last_extra, in_flight, logits)]
    else:
        stages = [(first_extra, in_flight, 0.0), (last_extra, 1.0, logits)]
    best = None
    for stage_extra, stage_acts, stage_logits in stages:
        dense = dense_layer + stage_extra
        # Megatron-Core shards the dense states over data-parallel x context-parallel ranks.
        wd, gd, od = _state_bytes(dense, layout.dp * layout.cp, cfg.zero, sharding, sixteen_bit, fp32_grads)
        we, ge, oe = _state_bytes(expert_layer, layout.expert_dp, cfg.zero, sharding, sixteen_bit, fp32_grads)
        sharded = cfg.zero.stage >= 1 and not cfg.zero.offload_optimizer
        step_temp = 0.0 if cfg.zero.offload_optimizer or cfg.engine.fused_adam else 4.0 * max(
            dense / (layout.dp * layout.cp if sharded else 1), expert_layer / (layout.expert_dp if sharded else 1))
        est = MemoryEstimate(
            weights_gib=(wd + we) / GIB,
            grads_gib=(gd + ge) / GIB,
            optimizer_gib=(od + oe) / GIB,
            activations_gib=(layers * per_layer * stage_acts + recompute_live) / GIB,
            logits_gib=stage_logits / GIB,
            optimizer_step_gib=step_temp / GIB,
        )
        if best is None or est.total_gib > best.total_gib:
            best = est
    return best


def host_memory_estimate(cfg, layout: ParallelLayout, engine, params: ParamCounts | None = None) -> MemoryEstimate:
    """One CPU process's memory: the per-rank terms of `estimate_memory`, with the runtime's
    footprint in place of the CUDA workspace. A CPU run on one machine needs this times its
    processes (cluster.gpus_per_node) of host memory."""
    return replace(estimate_memory(cfg, layout, engine, params), workspace_gib=CPU_PROCESS_GIB)
