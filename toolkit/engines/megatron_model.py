"""Building a Megatron-Core GPTModel from a composed experiment.

`transformer_config_kwargs` is the one mapping from gridwright's config to Megatron-Core's
TransformerConfig, FP8 included; it is pure data so tests check it without a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ..families.registry import family
from ..config.fp8_choice import fp8_backend, output_layer_in_fp8
from ..planning.layout import cp_exchange
from ..torch_internals.dynamo import raise_recompile_limit
from . import torch_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fused_kernels(engine, cluster) -> bool:
    """Whether Megatron-Core's own SwiGLU and cross-entropy fusions run (engine.fused_kernels;
    None: on CUDA only)."""
    chosen = engine.fused_kernels
    return cluster.device != "cpu" if chosen is None else bool(chosen)


def fused_cross_entropy(cfg) -> bool:
    """The fused cross-entropy only for bf16 weights: its backward returns the logits'
    gradient cast to bf16 (megatron/core/fusions/fused_cross_entropy.py), which in an fp32
    or fp16 run would round it silently (6.7e-4 relative in fp32, measured)."""
    return fused_kernels(cfg.engine, cfg.cluster) and cfg.precision.params_dtype == "bf16"


def gradient_accumulation_fusion(cfg) -> bool:
    """Whether the weight-gradient GEMMs add into Megatron-Core DDP's fp32 buffer themselves
    (engine.gradient_accumulation_fusion; None: on CUDA, where that buffer exists)."""
    chosen = cfg.engine.gradient_accumulation_fusion
    if chosen is not None:
        return bool(chosen)
    return cfg.cluster.device != "cpu" and cfg.engine.name == "megatron" and cfg.zero.stage < 3


def fusions_name(tcfg, wgrad_fused: bool = False) -> str:
    """The spec name's part for Megatron-Core's fusions, e.g. "+fused(swiglu,cross_entropy)";
    `wgrad_fused`: some linear adds its weight gradient into the buffer in its GEMM."""
    parts = [name for name, on in (("swiglu", tcfg.bias_activation_fusion),
                                   ("cross_entropy", tcfg.cross_entropy_loss_fusion),
                                   ("wgrad_accumulation", wgrad_fused)) if on]
    return f"+fused({','.join(parts)})" if parts else ""


def transformer_config_kwargs(cfg, layout, te_available: bool = True) -> dict:
    """Keyword arguments for megatron.core.transformer.TransformerConfig. FP8 appears in
    them only when Transformer Engine runs it; torchao's FP8 lives in the layers
    (choose_torch_native_paths)."""
    m, p, t = cfg.model, cfg.precision, cfg.train
    on_cpu = cfg.cluster.device == "cpu"
    dtype = DTYPES[p.params_dtype]
    kw = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,  # None: hidden_size / heads
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        activation_func=F.silu,
        gated_linear_unit=True,  # SwiGLU
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=p.params_dtype == "bf16",
        fp16=p.params_dtype == "fp16",
        **layout.megatron_sizes(),
        sequence_parallel=layout.sp,
        # Packed documents: the loss is a sum over tokens, divided by the global token count
        # (finalize_model_grads), so it does not depend on how documents were packed.
        calculate_per_token_loss=bool(cfg.data.packing),
        # Megatron-Core's torch.compile'd fusions (engine.fused_kernels); the ones below them
        # need Apex or TE kernels, so the torch paths run instead.
        bias_activation_fusion=fused_kernels(cfg.engine, cfg.cluster),
        cross_entropy_loss_fusion=fused_cross_entropy(cfg),
        cross_entropy_fusion_impl="native",
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # Transformer Engine's fused rotary kernel, where its layers are built (the torch-native
        # spec has none: Megatron-Core's fallback needs Apex)
        apply_rope_fusion=te_available and fused_kernels(cfg.engine, cfg.cluster),
        persist_layer_norm=False,
        # Apex's GEMM in Megatron-Core's own hook, supplied by torch (wgrad_accumulation)
        gradient_accumulation_fusion=gradient_accumulation_fusion(cfg),
        # Same initial weights for every TP layout of one seed (initialised whole on the CPU,
        # then split), which is what makes TP=1 and TP=2 runs comparable.
        use_cpu_initialization=on_cpu,
        # Megatron-LM's choice for the interleaved schedule: overlapped, unbatched p2p.
        # Measured on 2 x H200: with batched p2p the interleaved run barely learned (loss
        # 10.78 -> 10.63, against 10.78 -> 8.74 unbatched; evaluations/results/
        # bench_gpu_20261126-0344.md and -0347.md, in git history at bf0dede13eb6). On CPU
        # p2p_communication.py:398 would also synchronise CUDA when batching.
        batch_p2p_comm=not on_cpu and not layout.vpp,
        overlap_p2p_comm=bool(layout.vpp),
    )
    kw.update(family(m.family).megatron)  # the family's own settings (QKV bias, QK-norm)
    if m.num_experts:
        kw.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.ffn_hidden_size,
            moe_token_dispatcher_type=cfg.parallel.moe_token_dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_grouped_gemm=False,
        )
    exchange = cp_exchange(cfg.parallel, m, cfg.data, cfg.cluster.device == "cuda")
    if layout.cp > 1 and (not te_available or exchange == "a2a"):
        # Handed by Megatron-Core to each layer's core attention: SDPACoreAttention's form, or
        # Transformer Engine's, which takes the same names. Unset, TE runs its ring (p2p),
        # which the default all_gather leaves it: TE's all-gather form does not take packed
        # documents.
        kw.update(cp_comm_type=exchange)
    if cfg.engine.cuda_graphs == "layers":
        # Megatron-Core's own graphs, one per layer (the whole layer: scope []); recorded on
        # the first step, captured when its schedule ends, replayed from then on.
        kw.update(cuda_graph_impl="local", cuda_graph_scope=[])
    if t.recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif t.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if fp8_backend(p, te_available) == "transformer_engine":
        kw.update(
            fp8=p.fp8_format,
            fp8_recipe=p.fp8_recipe,
            fp8_amax_history_len=p.fp8_amax_history_len,
            fp8_amax_compute_algo=p.fp8_amax_compute_algo,
            fp8_param=p.fp8_param,
        )
    return kw


class SDPACoreAttention(MegatronModule):
    """Core attention through torch's scaled_dot_product_attention (flash / memory-efficient).

    Megatron-Core's own fallback materialises the S x S score matrix; on one H200 it gave
    18.7 % MFU where SDPA gave 30.3 % (measured while building this module). Receives [s, b, heads, dim] tensors
    (key/value with the GQA group count) and returns [s, b, heads * dim]; packed documents
    (`packed_seq_params.qkv_format == "thd"`) arrive as [t, heads, dim]. A single document
    of a dynamic-CP schedule arrives as [s, 1, heads, dim] with its own CP group in
    `packed_seq_params.cp_group`. The computations are in `torch_attention`.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_size = config.context_parallel_size
        self.cp_all_to_all = cp_comm_type == "a2a"  # from TransformerConfig.cp_comm_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        from megatron.core import parallel_state as ps

        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention bias")
        dropout = self.dropout if self.training else 0.0
        psp = packed_seq_params
        if psp is not None and psp.qkv_format == "thd":  # built by torch_attention.thd_params
            if self.cp_size > 1:
                out = torch_attention.context_parallel_documents(
                    query, key, value, psp, ps.get_context_parallel_group(), self.softmax_scale, dropout)
            else:
                out = torch_attention.documents(query, key, value, psp, self.softmax_scale, dropout)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # -> [b, heads, s, dim]
        group = psp.cp_group if psp is not None else (ps.get_context_parallel_group() if self.cp_size > 1 else None)
        if group is not None and group.size() > 1:
            form = torch_attention.context_parallel_a2a if self.cp_all_to_all else torch_attention.context_parallel
            out = form(q, k, v, group, self.softmax_scale, dropout)
        else:
            out = torch_attention.causal_sdpa(q, k, v, self.softmax_scale, dropout)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class TorchRMSNorm(torch.nn.Module):
    """RMSNorm through torch.nn.functional.rms_norm, usable with sequence parallelism.

    Under SP each TP rank normalises a different slice of the sequence, so the weight's
    gradient is partial: marking it `sequence_parallel` makes Megatron-Core's
    finalize_model_grads all-reduce it over the TP group. (Megatron-Core's own torch norm
    refuses SP; its fused norms need TE or Apex.) Computed in fp32 for bf16 inputs.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)


def choose_torch_native_paths(cfg, tcfg, te_available: bool) -> None:
    """Record on the TransformerConfig which torch-native replacements the layers use (read
    by gridwright.megatron_internals.parallel_linear); `spec_name` then says what was built."""
    tcfg.gridwright_tp_comm_overlap = bool(not te_available and cfg.engine.tp_comm_overlap and cfg.parallel.sp)
    tcfg.gridwright_float8 = None
    backend = fp8_backend(cfg.precision, te_available)
    if not te_available and backend == "torchao":
        from ..megatron_internals.parallel_linear import float8_setup

        tcfg.gridwright_float8 = float8_setup(cfg.precision.fp8_recipe, emulate=cfg.cluster.device == "cpu")
        tcfg.gridwright_float8_name = (f"float8_{cfg.precision.fp8_recipe}(torchao"
                                       f"{', emulated' if cfg.cluster.device == 'cpu' else ''})")
    output_layer = output_layer_in_fp8(cfg.precision, backend, cfg.parallel, cfg.model, cfg.cluster.device == "cuda")
    if backend == "transformer_engine" and output_layer:
        # GPTModel builds its output layer as Megatron-Core's own ColumnParallelLinear, named
        # by no spec and run outside TE's FP8 autocast (the TransformerBlock enters it), so
        # TE cannot take it without new parameters and checkpoint keys. gridwright's torchao
        # float8 matmul takes it in place, with the same weight. The TE layers never read
        # gridwright_float8 (only gridwright's linears do).
        from ..megatron_internals.parallel_linear import float8_setup

        tcfg.gridwright_float8 = float8_setup("tensorwise", emulate=False)
        tcfg.gridwright_float8_name = "float8_tensorwise(torchao)"
    tcfg.gridwright_float8_output_layer = tcfg.gridwright_float8 is not None and output_layer


def spec_name(chunks, tcfg, te_available: bool) -> str:
    """What the built model runs, read from the model itself (for the summary), e.g.
    "local+sdpa+compiled+tp_overlap+float8_tensorwise(torchao)"."""
    if te_available:
        return _te_spec_name(chunks, tcfg)
    from ..megatron_internals.parallel_linear import routes_weight_gradients

    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    name = "local+sdpa"
    if layers and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers):
        name += "+compiled"
    # The torch-native spec always holds gridwright's linears (layer_spec); these flags are
    # what they read (unset where choose_torch_native_paths did not run: DeepSpeed's TP).
    if getattr(tcfg, "gridwright_tp_comm_overlap", False):
        name += "+tp_overlap"
    float8 = getattr(tcfg, "gridwright_float8", None) is not None
    float8_outputs = [is_float8_output_layer(chunk.output_layer) for chunk in chunks if chunk.post_process]
    if float8:
        name += "+" + tcfg.gridwright_float8_name
        if any(float8_outputs):
            name += "+float8_output_layer"
    # Float8 linears fuse only where they are routed (TP=1, tensorwise); otherwise, with the
    # output layer in float8 too (or absent), none does
    every_linear_float8 = float8 and all(float8_outputs)
    float8_fuses = float8 and routes_weight_gradients(tcfg, tcfg.tensor_model_parallel_size)
    name += fusions_name(tcfg, tcfg.gradient_accumulation_fusion and (float8_fuses or not every_linear_float8))
    if any(getattr(layer.self_attention.core_attention, "cp_all_to_all", False) for layer in layers):
        name += "+cp_a2a"
    if tcfg.cuda_graph_impl == "local":
        name += "+cuda_graphs(layers)"
    return name


def _te_spec_name(chunks, tcfg) -> str:
    """The Transformer Engine spec's name, e.g. "transformer_engine+fp8(delayed,hybrid)+fused(rope,...)"."""
    name = "transformer_engine"
    if tcfg.fp8:
        name += f"+fp8({tcfg.fp8_recipe},{tcfg.fp8})"
    fused = [n for n, on in (("rope", tcfg.apply_rope_fusion), ("swiglu", tcfg.bias_activation_fusion),
                             ("cross_entropy", tcfg.cross_entropy_loss_fusion),
                             ("wgrad_accumulation", tcfg.gradient_accumulation_fusion)) if on]
    if any(is_float8_output_layer(chunk.output_layer) for chunk in chunks if chunk.post_process):
        name += f"+float8_output_layer({tcfg.gridwright_float8_name})"
    if fused:
        name += f"+fused({','.join(fused)})"
    if tcfg.cuda_graph_impl != "none":
        name += f"+cuda_graphs({tcfg.cuda_graph_impl})"
    return name


def captured_graphs(chunks) -> int:
    """CUDA graphs Megatron-Core captured for these chunks' layers (a forward and a backward
    per layer and in-flight micro-batch): the summary's proof that graphs replayed."""
    runners = [r for chunk in chunks for layer in chunk.decoder.layers
               for r in getattr(getattr(layer, "cudagraph_manager", None), "cudagraph_runners", [])]
    return sum((r.fwd_graph is not None) + (r.bwd_graph is not None) for r in runners)


def compile_layers(chunks) -> None:
    """torch.compile every transformer layer in place (`nn.Module.compile`: parameter names,
    and so checkpoints, stay as they are). Per layer rather than the whole model: the
    pipeline schedules call the model chunk by chunk, and one layer's graph is reused by
    every layer of the same shape. Where DDP's parameter-gather pre-hooks differ per layer
    (overlap_param_gather), each layer gets its own graph: dynamo's recompile limit (8 by
    default, after which layers silently run eagerly) is raised to cover every layer."""
    raise_recompile_limit(sum(len(chunk.decoder.layers) for chunk in chunks))
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            layer.compile()


def layer_spec(model, tcfg, te_available: bool, vp_stage=None):
    """Transformer Engine's spec when TE imports; else a torch-native one (SDPA, TorchRMSNorm).

    The torch-native spec is Megatron-Core's local spec with two parts injected, so its
    checkpoints keep the local (TE-compatible) parameter names.
    """
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_experts = model.num_experts or None
    if te_available:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=tcfg.qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=tcfg.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if tcfg.qk_layernorm:  # per-head norms of queries and keys (Qwen3)
        spec.submodules.self_attention.submodules.q_layernorm = TorchRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = TorchRMSNorm
    spec.submodules.input_layernorm = TorchRMSNorm
    spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    # gridwright's linears always (they are Megatron-Core's unless tp_comm_overlap or torchao
    # FP8 asks for more): the row-parallel one also passes its TP group on, which upstream's
    # forward does not (see parallel_linear).
    from ..megatron_internals.parallel_linear import GridwrightColumnParallelLinear, GridwrightRowParallelLinear

    attention = spec.submodules.self_attention.submodules
    attention.linear_qkv, attention.linear_proj = GridwrightColumnParallelLinear, GridwrightRowParallelLinear
    if not num_experts:  # experts keep Megatron-Core's (validation refuses torchao FP8 with MoE)
        mlp = spec.submodules.mlp.submodules
        mlp.linear_fc1, mlp.linear_fc2 = GridwrightColumnParallelLinear, GridwrightRowParallelLinear
    layers = get_num_layers_to_build(tcfg, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=TorchRMSNorm)


def build_model_chunks(model, parallel, tcfg, te_available: bool) -> list:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if tcfg.gradient_accumulation_fusion:
        from ..megatron_internals.wgrad_accumulation import provide

        provide()  # before the linears are built: they check for the fused GEMM
    vpp = parallel.vpp or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if parallel.vpp else None
        chunk = GPTModel(
            config=tcfg,
            transformer_layer_spec=layer_spec(model, tcfg, te_available, vp_stage=stage),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
            rope_scaling=model.rope_scaling_factor is not None,
            rope_scaling_factor=model.rope_scaling_factor or 8.0,
            vp_stage=stage,
        )
        if chunk.post_process and getattr(tcfg, "gridwright_float8_output_layer", False):
            from ..megatron_internals.parallel_linear import float8_output_layer

            emulated = tcfg.gridwright_float8[0].emulate  # CPU: eager, as the tests run it
            float8_output_layer(chunk.output_layer, compile_matmul=not emulated)
        chunks.append(chunk)
    return chunks


def is_float8_output_layer(layer) -> bool:
    from ..megatron_internals.parallel_linear import GridwrightColumnParallelLinear

    return isinstance(layer, GridwrightColumnParallelLinear)
