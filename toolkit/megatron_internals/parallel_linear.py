"""The torch-native spec's column- and row-parallel linear layers: Megatron-Core's, with two
optional replacements where Transformer Engine is absent.

* `tp_comm_overlap` (sequence parallelism): the all-gather before a column-parallel matmul
  and the reduce-scatter after a row-parallel one are fused with the matmul through torch's
  symmetric-memory ops (`torch.ops.symm_mem.fused_all_gather_matmul` and
  `fused_matmul_reduce_scatter`), the way TorchTitan's async TP does it: the matmul is cut
  into one piece per rank and each piece runs while the next shard is copied. The backward
  uses the same two ops the other way round. Those ops exist for CUDA only; on CPU the same
  autograd functions run the plain collective and matmul, so the CPU tests check their
  arithmetic (saved tensors, gradients) against one process.
* `fp8` (torchao): the matmul itself in float8 through torchao's
  `matmul_with_hp_or_float8_args` (dynamic tensorwise or rowwise scaling, forward and
  backward), the function torchao's own `Float8Linear` calls, or, where the weight
  gradient is added into DDP's buffer in its GEMM (TP=1, tensorwise:
  `accumulate_weight_gradients_in_gemm`), `wgrad_accumulation.Float8AccumulatingMatmul`,
  with torchao's scaling and casts. Only the local matmul changes: the tensor-parallel
  communication stays Megatron-Core's (in bf16).

Parameter names, shapes and sharding are Megatron-Core's, so checkpoints do not change.
The subclasses override Megatron-Core's private `_forward_impl` hook (and, for the
row-parallel layer, `forward`, with the attributes it reads), which is why they live
behind this package's version fence; CITED names the upstream lines they rely on.
Why not torchao's `convert_to_float8_training`: it swaps `nn.Linear` modules, and
Megatron-Core's parallel linears are not `nn.Linear`.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .wgrad_accumulation import AccumulatingMatmul, Float8AccumulatingMatmul, flag_added_gradients, float8_accumulates

CITED = [
    ("tensor_parallel/layers.py", "def _forward_impl(self, input, weight, *args, **kwargs):"),
    ("tensor_parallel/layers.py", "output_parallel = self._forward_impl("),
    ("tensor_parallel/layers.py", "output_ = reduce_scatter_to_sequence_parallel_region("),
    # RowParallelLinear.forward hands _forward_impl no group (the warning _forward_impl avoids)
    ("tensor_parallel/layers.py", "sequence_parallel=False,\n            tp_group=None,\n            grad_output_buffer=None,"),
    ("utils.py", "Warning: tp_group is None, using default tp group."),
]


def float8_setup(recipe: str, emulate: bool = False):
    """torchao's Float8LinearConfig of a recipe and the matching LinearMMConfig.
    `emulate`: float8 arithmetic emulated in high precision (CPU tests)."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    mm = [ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
          for g in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)]
    return config, LinearMMConfig(*mm)


def _matmul(x, weight, fp8):
    """x @ weight.T, in float8 through torchao when `fp8` is (config, mm_config)."""
    if fp8 is None:
        return torch.matmul(x, weight.t())
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    config, mm_config = fp8
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)


# The two communicating matmuls -------------------------------------------------------------
_SYMMETRIC_MEMORY = {}  # group name -> (torch.ops.symm_mem, name) or None: asked once per group


def _symmetric_memory_ops(group):
    """torch's fused ops and the group's name, or None where they cannot run (CPU). Called
    for every matmul: the answer is worked out once per group."""
    if group.group_name not in _SYMMETRIC_MEMORY:
        _SYMMETRIC_MEMORY[group.group_name] = _enable_symmetric_memory(group)
    return _SYMMETRIC_MEMORY[group.group_name]


def _enable_symmetric_memory(group):
    if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
        return None
    import warnings

    import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem

    if not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        with warnings.catch_warnings():  # deprecated (a no-op) in newer torch, needed in older
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    return torch.ops.symm_mem, group.group_name


def all_gather_matmul(shard, weight, group):
    """(all_gather(shard) along dim 0, all_gather(shard) @ weight.T); `shard` is 2-D."""
    ops = _symmetric_memory_ops(group)
    if ops is not None:
        symm, name = ops
        gathered, (out,) = symm.fused_all_gather_matmul(shard, [weight.t()], 0, name)
        return gathered, out
    gathered = shard.new_empty((shard.shape[0] * group.size(), shard.shape[1]))
    dist.all_gather_into_tensor(gathered, shard.contiguous(), group=group)
    return gathered, torch.matmul(gathered, weight.t())


def matmul_reduce_scatter(x, weight_t, group):
    """reduce_scatter(x @ weight_t) along dim 0 (sum); `x` is 2-D."""
    ops = _symmetric_memory_ops(group)
    if ops is not None:
        symm, name = ops
        return symm.fused_matmul_reduce_scatter(x, weight_t, "sum", 0, name)
    full = torch.matmul(x, weight_t)
    out = full.new_empty((full.shape[0] // group.size(), full.shape[1]))
    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
    return out


class _AllGatherMatmul(torch.autograd.Function):
    """Column-parallel matmul under SP: y = all_gather(x) @ W.T, x [s/tp, b, h].
    Backward: dx = reduce_scatter(dy @ W), dW = dy.T @ all_gather(x). The gathered input is
    kept from forward (the fused op returns it), not re-gathered as Megatron-Core does:
    TP times the activation memory of SP's shard for the QKV and FC1 inputs."""

    @staticmethod
    def forward(ctx, x, weight, group):
        s, b, h = x.shape
        gathered, out = all_gather_matmul(x.reshape(s * b, h), weight, group)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.shape = group, x.shape
        return out.view(s * group.size(), b, -1)

    @staticmethod
    def backward(ctx, grad_out):
        gathered, weight = ctx.saved_tensors
        grad_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = matmul_reduce_scatter(grad_out, weight, ctx.group)
        grad_weight = torch.matmul(grad_out.t(), gathered)
        return grad_x.view(ctx.shape), grad_weight, None


class _MatmulReduceScatter(torch.autograd.Function):
    """Row-parallel matmul under SP: y = reduce_scatter(x @ W.T), x [s, b, h/tp].
    Backward: all_gather(dy) and dx = all_gather(dy) @ W in one op; dW = all_gather(dy).T @ x."""

    @staticmethod
    def forward(ctx, x, weight, group):
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        ctx.save_for_backward(flat, weight)
        ctx.group, ctx.shape = group, x.shape
        return matmul_reduce_scatter(flat, weight.t(), group).view(s // group.size(), b, -1)

    @staticmethod
    def backward(ctx, grad_out):
        flat, weight = ctx.saved_tensors
        grad_full, grad_x = all_gather_matmul(grad_out.reshape(-1, grad_out.shape[-1]), weight.t(), ctx.group)
        grad_weight = torch.matmul(grad_full.t(), flat)
        return grad_x.view(ctx.shape), grad_weight, None


# The layers --------------------------------------------------------------------------------
def _choices(config):
    """(overlap, fp8) for a layer, read from attributes gridwright sets on the config."""
    return getattr(config, "gridwright_tp_comm_overlap", False), getattr(config, "gridwright_float8", None)


class GridwrightColumnParallelLinear(ColumnParallelLinear):
    """Megatron-Core's ColumnParallelLinear; the matmul (and SP's all-gather) replaced as the
    module docstring says."""

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                      sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None):
        if getattr(self, "gridwright_accumulates_wgrad", False) and weight.requires_grad:
            out = _accumulating_matmul(self, input, weight)
            return out if bias is None else out + bias
        overlap, fp8 = _choices(self.config)
        if not weight.requires_grad or not (overlap and sequence_parallel or fp8):
            # by keyword: upstream's function has a deprecated parameter before tp_group
            return super()._forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                         sequence_parallel, grad_output_buffer=grad_output_buffer,
                                         wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group)
        if sequence_parallel and fp8 is None:  # overlap
            out = _AllGatherMatmul.apply(input, weight, self.tp_group)
        else:
            if sequence_parallel:  # fp8 with SP: Megatron-Core's gather, then the float8 matmul
                input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                             group=self.tp_group)
            elif allreduce_dgrad:  # what the fused function does in its backward
                input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
            matmul = _compiled_matmul() if getattr(self, "gridwright_compile_matmul", False) else _matmul
            out = matmul(input, weight, fp8)
        return out if bias is None else out + bias


def float8_output_layer(layer: ColumnParallelLinear, compile_matmul: bool) -> None:
    """Run a GPTModel's output layer through the float8 matmul (precision.fp8_output_layer).
    GPTModel builds it as Megatron-Core's ColumnParallelLinear with no spec to name another
    class, so its class is switched in place to the subclass, which adds no state:
    parameters, names and checkpoints stay the same. `compile_matmul` (CUDA): the layer
    sits outside the compiled transformer layers, and eagerly torchao's scaling and casts
    of the [tokens, vocabulary] gradient ran as separate kernels that cost more than the
    float8 GEMM saved (200 ms a step on the Llama-3-8B shape, 16 layers, one H200);
    compiled, inductor fuses them."""
    if type(layer) is not ColumnParallelLinear:
        raise TypeError(f"expected Megatron-Core's ColumnParallelLinear as the output layer, got {type(layer)}")
    layer.__class__ = GridwrightColumnParallelLinear
    layer.gridwright_compile_matmul = compile_matmul


@functools.cache
def _compiled_matmul():
    """`_matmul` through torch.compile, made once per process (one output layer shape)."""
    return torch.compile(_matmul)


def _float8_accumulating_matmul(x, weight, main_grad, config):
    return Float8AccumulatingMatmul.apply(x, weight, main_grad, config)


@functools.cache
def _compiled_float8_accumulating_matmul():
    """The same through torch.compile, for the output layer (`float8_output_layer` says why)."""
    return torch.compile(_float8_accumulating_matmul)


def _accumulating_matmul(layer, x, weight):
    """x @ weight.T whose backward adds the weight's gradient into its DDP buffer (a layer
    `accumulate_weight_gradients_in_gemm` routed): in bf16, or in float8 where it runs."""
    fp8 = _choices(layer.config)[1]
    if fp8 is None:
        return AccumulatingMatmul.apply(x, weight, weight.main_grad)
    compiled = getattr(layer, "gridwright_compile_matmul", False)
    matmul = _compiled_float8_accumulating_matmul() if compiled else _float8_accumulating_matmul
    return matmul(x, weight, weight.main_grad, fp8[0])


class GridwrightRowParallelLinear(RowParallelLinear):
    """Megatron-Core's RowParallelLinear; the matmul (and SP's reduce-scatter) replaced as the
    module docstring says."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        # Upstream's forward passes tp_group=None, and Megatron-Core then warns on rank 0 only,
        # on every call. Eagerly that is host time on one rank; compiled, each warning is a
        # graph break on rank 0 alone, so rank 0 runs more graphs per layer than the others and
        # they wait for it at every collective. The layer's own group is the same group.
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        if getattr(self, "gridwright_accumulates_wgrad", False) and weight.requires_grad:
            return _accumulating_matmul(self, input, weight)
        overlap, fp8 = _choices(self.config)
        if fp8 is None or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _matmul(input, weight, fp8)

    def forward(self, input_):
        overlap, fp8 = _choices(self.config)
        if not (overlap and self.sequence_parallel and fp8 is None and not self.explicit_expert_comm):
            return super().forward(input_)
        out = _MatmulReduceScatter.apply(input_, self.weight, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


def accumulate_weight_gradients_in_gemm(model) -> int:
    """Route the matmuls of gridwright's linears at TP=1 (no communication inside them)
    through `AccumulatingMatmul`, or `Float8AccumulatingMatmul` under torchao's tensorwise
    float8, where the TransformerConfig asks for gradient-accumulation fusion. At TP>1 the
    linears that run Megatron-Core's function (no tp_comm_overlap, no float8) fuse inside it
    (the GEMM of wgrad_accumulation.provide); gridwright's async-TP matmuls, its float8
    matmuls at TP>1 and under rowwise scaling do not fuse. Called once DDP has given each
    weight its `main_grad`. Returns how many linears were routed.

    Not under Megatron-Core's CUDA graphs: on one H200 (bench model, 14 steps) the routed run
    left the same run without graphs at the third step (gradient norm 5.6225 against 5.629,
    then 10.154 against 10.170), 5 times further than a graph run through Megatron-Core's
    own function left its partner (5.6277 against 5.6289); no repeats were run, and the
    cause was not traced. A graph replays the whole layer, so that function's graph breaks in
    compiled layers cost no time there (87,436 tokens/s through it in one call, 87,238 routed
    in another)."""
    routed = 0
    for layer in model.modules():
        if not isinstance(layer, (GridwrightColumnParallelLinear, GridwrightRowParallelLinear)):
            continue
        weight = layer.weight  # None on an output layer tied to the embedding (it is handed the weight)
        if (weight is not None and routes_weight_gradients(layer.config, layer.tp_group.size()) and weight.requires_grad
                and hasattr(weight, "main_grad") and not getattr(weight, "zero_out_wgrad", False)):
            layer.gridwright_accumulates_wgrad = True
            flag_added_gradients(weight)
            routed += 1
    return routed


def routes_weight_gradients(config, tp_size: int) -> bool:
    """Whether `accumulate_weight_gradients_in_gemm` routes gridwright's linears under this
    TransformerConfig (those with a trainable, untied weight): bf16, or float8 where
    `Float8AccumulatingMatmul` runs its recipe."""
    fp8 = _choices(config)[1]
    return (config.gradient_accumulation_fusion and tp_size == 1 and config.cuda_graph_impl != "local"
            and (fp8 is None or float8_accumulates(fp8[0])))
