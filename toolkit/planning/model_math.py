"""Parameter counts and FLOPs of a Llama/Mixtral-shaped decoder, from its config alone.

The one owner of "FLOPs per token" in gridwright. Two named definitions, because
published MFU figures use both and differ by up to 15 % on long sequences:

``megatron`` (the default), Megatron-LM's ``num_floating_point_operations`` (2025 on):
    per token = 3 (forward, weight-gradient and data-gradient GEMMs) x 2 (a multiply-add)
      x [ matmul parameters on the token's path
          = per layer: QKV (GQA: heads + 2 x query groups) + output projection
                       + SwiGLU MLP (3 matrices), or top-k experts' MLPs for MoE
          + the logit layer (hidden x vocab); embeddings and the MoE router not counted
        + per layer: seq_length x (heads x head_dim) / 2 ]   attention scores and
                                                               attention x V, causal:
                                                               only half the S x S
                                                               matrix is computed
``palm`` (PaLM appendix B; TorchTitan): the same, with the attention term not halved
    (12 x layers x seq_length x heads x head_dim per token) and the router counted.

MFU = achieved FLOP/s per GPU (under a definition) / the GPU's dense peak (bf16, or
fp8 for FP8 runs). HFU counts what the hardware executes: the model FLOPs plus the
recomputed forward passes (selective recompute: the attention-score part of the
forward again; full recompute: the whole forward again).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFINITIONS = ("megatron", "palm")
DEFAULT_DEFINITION = "megatron"
# The definitions that count half of the causal attention scores (a causal mask skips half).
HALVES_CAUSAL_SCORES = {"megatron": True, "palm": False}


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding
    output: int  # output layer (0 when tied to the embedding)
    attention_per_layer: int  # QKV + output projection
    norms_per_layer: int
    dense_mlp_per_layer: int  # 0 for MoE models
    router_per_layer: int
    expert_per_layer: int  # all experts of one layer
    num_layers: int

    @property
    def per_layer_dense(self) -> int:
        return self.attention_per_layer + self.norms_per_layer + self.dense_mlp_per_layer + self.router_per_layer

    @property
    def total(self) -> int:
        return (
            self.embedding + self.output + self.num_layers * (self.per_layer_dense + self.expert_per_layer)
        )


def param_counts(model) -> ParamCounts:
    h, f, L = model.hidden_size, model.ffn_hidden_size, model.num_layers
    heads, groups, V = model.num_attention_heads, model.num_query_groups, model.vocab_size
    head_dim = getattr(model, "head_dim", None) or h // heads
    qkv = h * (heads + 2 * groups) * head_dim
    attn = qkv + heads * head_dim * h
    mlp_one = 3 * h * f  # SwiGLU: gate, up, down
    moe = model.num_experts > 0
    return ParamCounts(
        embedding=V * h,
        output=0 if model.tie_embeddings else V * h,
        attention_per_layer=attn,
        # QKV biases (Qwen2) sit with the norms: parameters that are not matmul FLOPs.
        norms_per_layer=2 * h + (heads + 2 * groups) * head_dim * bool(getattr(model, "qkv_bias", False)),
        dense_mlp_per_layer=0 if moe else mlp_one,
        router_per_layer=h * model.num_experts if moe else 0,
        expert_per_layer=model.num_experts * mlp_one if moe else 0,
        num_layers=L,
    )


def _active_matmul_params(model, pc: ParamCounts, count_router: bool) -> int:
    """Weights a token multiplies with: attention, its MLP (or top-k experts), the logits."""
    h, f, L, V = model.hidden_size, model.ffn_hidden_size, model.num_layers, model.vocab_size
    mlp = model.moe_router_topk * 3 * h * f if model.num_experts else pc.dense_mlp_per_layer
    router = pc.router_per_layer if count_router else 0
    return L * (pc.attention_per_layer + mlp + router) + h * V


def _attention_score_flops(model, seq_length: int) -> int:
    """Forward FLOPs per token of Q K^T and scores x V with the full S x S matrix."""
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    attn_width = model.num_attention_heads * head_dim
    return 2 * 2 * model.num_layers * seq_length * attn_width


def forward_flops_parts(model, seq_length: int, params: ParamCounts | None = None) -> dict[str, float]:
    """Forward FLOPs per token by the kernel class a GPU runs them in, as it runs them (a
    causal attention kernel skips half the scores; the router is not a GEMM worth counting):
    one layer's GEMMs, one layer's attention, and the logit layer's GEMM."""
    pc = params or param_counts(model)
    h, f = model.hidden_size, model.ffn_hidden_size
    mlp = model.moe_router_topk * 3 * h * f if model.num_experts else pc.dense_mlp_per_layer
    return {"layer_matmul": 2.0 * (pc.attention_per_layer + mlp),
            "layer_attention": _attention_score_flops(model, seq_length) / model.num_layers / 2,
            "output": 2.0 * h * model.vocab_size}


def forward_flops_per_token(model, seq_length: int, definition: str = DEFAULT_DEFINITION,
                            params: ParamCounts | None = None) -> float:
    """`params`: the model's parameter counts where the caller has them (a plan does)."""
    if definition not in DEFINITIONS:
        raise ValueError(f"unknown FLOPs definition '{definition}'; choose one of {', '.join(DEFINITIONS)}")
    pc = params or param_counts(model)
    matmul = 2 * _active_matmul_params(model, pc, count_router=definition == "palm")
    scores = _attention_score_flops(model, seq_length)
    return float(matmul + (scores / 2 if HALVES_CAUSAL_SCORES[definition] else scores))


def model_flops_per_token(model, seq_length: int, definition: str = DEFAULT_DEFINITION,
                          params: ParamCounts | None = None) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU."""
    return 3.0 * forward_flops_per_token(model, seq_length, definition, params)


def hardware_flops_per_token(model, seq_length: int, recompute: str, definition: str = DEFAULT_DEFINITION,
                             params: ParamCounts | None = None) -> float:
    """FLOPs the hardware executes, counting recomputed forward passes (HFU)."""
    pc = params or param_counts(model)
    model_flops = model_flops_per_token(model, seq_length, definition, pc)
    if recompute == "full":
        return model_flops + forward_flops_per_token(model, seq_length, definition, pc)
    if recompute == "selective":  # Megatron recomputes the core attention only
        scores = _attention_score_flops(model, seq_length)
        return model_flops + (scores / 2 if HALVES_CAUSAL_SCORES[definition] else scores)
    return model_flops


def flops_per_token_all(model, seq_length: int, params: ParamCounts | None = None) -> dict[str, float]:
    """Model FLOPs per token under every definition, for records that name them all."""
    pc = params or param_counts(model)
    return {d: model_flops_per_token(model, seq_length, d, pc) for d in DEFINITIONS}


def flops_record(cfg, params: ParamCounts | None = None) -> dict:
    """What every MFU number of a run is computed from: definition, FLOPs/token, peak."""
    pc = params or param_counts(cfg.model)
    t = cfg.train
    fp8 = cfg.precision.fp8_recipe is not None
    gpu = cfg.cluster.gpu
    definition = cfg.evaluate.flops_definition
    record = {
        "flops_definition": definition,
        "flops_per_token": flops_per_token_all(cfg.model, t.seq_length, pc),
        "hardware_flops_per_token": hardware_flops_per_token(cfg.model, t.seq_length, t.recompute, definition, pc),
        "peak_kind": "fp8" if fp8 else "bf16",
        "peak_tflops": float(gpu.peak_fp8_tflops if fp8 else gpu.peak_bf16_tflops),
    }
    if cfg.data.packing:
        # A token of a packed document attends to its own document only: each step's FLOPs
        # are those of its documents' mean context (sum of length² / sum of length) instead
        # of seq_length. The record keeps what a context token adds, per definition.
        shorter = t.seq_length - 1
        record["flops_per_context_token"] = {
            d: record["flops_per_token"][d] - model_flops_per_token(cfg.model, shorter, d, pc) for d in DEFINITIONS}
        record["hardware_flops_per_context_token"] = (
            record["hardware_flops_per_token"] - hardware_flops_per_token(cfg.model, shorter, t.recompute, definition, pc))
        record["seq_length"] = t.seq_length
    return record
