"""Megatron-Core's gradient-accumulation fusion without Apex: each linear's weight-gradient
GEMM adds its product straight into the fp32 `main_grad` buffer of Megatron-Core's DDP.

Unfused, a linear's backward writes a bf16 weight gradient, and DDP's hook then adds it
into the fp32 buffer (`main_grad.add_(grad)`, the kernel `CUDAFunctor_add<float>`): on the
Llama-3-8B shape (16 layers, micro-batch 2, four micro-batches a step, one H200) that was
74 ms a step in 396 launches. Megatron-Core fuses the two when the TransformerConfig asks
for `gradient_accumulation_fusion`, by calling Apex's `fused_weight_gradient_mlp_cuda`
extension (a cuBLAS GEMM whose epilogue adds into an fp32 C). Apex needs nvcc to build and
is not on the GPU machines; torch has the same GEMM (`torch.addmm` with `out_dtype`, CUDA
only), so this module supplies the two functions Megatron-Core calls, under that
extension's name, and tells Megatron-Core the extension is there (`provide`).

On CPU there is no mixed-dtype GEMM: the inputs are upcast to the buffer's dtype first,
the same sum without the saving (the CPU tests check the arithmetic, not the speed).
Megatron-Core itself sets `grad_added_to_main_grad` and hands autograd an unwritten
gradient, which DDP's hook then skips; tied embeddings get a zeroed one (`zero_out_wgrad`).

Compiled layers cannot go through Megatron-Core's function: its backward sets attributes
and writes a tensor that is not one of its inputs, so dynamo ran it outside the graph, and
each layer became 22 graphs instead of 5. On one H200 that made the bench model at
micro-batch 2 host-bound (502 ms of host wait a step). `AccumulatingMatmul` is the same
arithmetic in a form dynamo keeps in the graph: the buffer is an input, and the GEMM is a
custom op that declares it mutates it. The flag DDP's hook reads is set by a pre-hook on
the weight's gradient accumulator (`flag_added_gradients`), outside the graph.

Float8 linears (torchao's tensorwise recipe) fuse too: `Float8AccumulatingMatmul` runs the
three GEMMs of torchao's `matmul_with_hp_or_float8_args` with torchao's own scaling and
casts, but its weight-gradient GEMM adds into the buffer (`torch_internals.float8_gemm`, cuBLASLt
with beta = 1), where `torch._scaled_mm` would write a bf16 gradient for DDP's hook to add.
It needs its own autograd function because torchao's computes the weight gradient inside its
backward; it works on plain float8 tensors (not torchao's tensor subclass), so compiled
layers trace it as they trace the bf16 form.
"""
from __future__ import annotations

import sys

import torch

from ..torch_internals.float8_gemm import accumulate_float8_gemm

CITED = [
    # the calls this module answers, and the availability check `provide` satisfies
    ("tensor_parallel/layers.py", "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32("),
    ("tensor_parallel/layers.py", "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16("),
    ("tensor_parallel/layers.py", "if config.gradient_accumulation_fusion and not _grad_accum_fusion_available:"),
    # DDP's hook skips the add for a gradient the GEMM already accumulated
    ("distributed/distributed_data_parallel.py",
     "not param.grad_added_to_main_grad or getattr(param, 'zero_out_wgrad', False)"),
]


def accumulate_weight_gradient(total_input, grad_output, main_grad) -> None:
    """main_grad += grad_output.T @ total_input (both 2-D: [tokens, out] and [tokens, in]),
    in one GEMM whose output is the buffer itself."""
    a, b = grad_output.t(), total_input
    if a.dtype == main_grad.dtype:
        main_grad.addmm_(a, b)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype))


@torch.library.custom_op("gridwright::accumulate_weight_gradient", mutates_args=("main_grad",))
def _accumulate_op(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    accumulate_weight_gradient(total_input, grad_output, main_grad)


@_accumulate_op.register_fake
def _(total_input, grad_output, main_grad):
    return None


class AccumulatingMatmul(torch.autograd.Function):
    """y = x @ W.T, whose backward adds dW into `main_grad` (W's DDP buffer) and hands
    autograd an unwritten dW of W's shape, so that DDP's hook still runs (its overlapped
    reduction counts the hooks) and skips the add (`flag_added_gradients`)."""

    @staticmethod
    def forward(ctx, x, weight, main_grad):
        ctx.save_for_backward(x, weight)
        # Not saved for backward: the buffer changes between this forward and its backward
        # (other micro-batches' backwards, other layers' views of the same buffer), which
        # autograd's check of saved tensors would refuse; Megatron-Core's function keeps it
        # on ctx for the same reason (tensor_parallel/layers.py).
        ctx.main_grad = main_grad
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        _accumulate_op(x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1]), ctx.main_grad)
        return torch.matmul(grad_out, weight), torch.empty_like(weight), None


@torch.library.custom_op("gridwright::accumulate_float8_weight_gradient", mutates_args=("main_grad",))
def _accumulate_float8_op(grad_output_t: torch.Tensor, grad_output_inverse_scale: torch.Tensor,
                          input_t: torch.Tensor, input_inverse_scale: torch.Tensor, main_grad: torch.Tensor,
                          use_fast_accum: bool) -> None:
    accumulate_float8_gemm(grad_output_t, grad_output_inverse_scale, input_t, input_inverse_scale, main_grad,
                           use_fast_accum)


@_accumulate_float8_op.register_fake
def _(grad_output_t, grad_output_inverse_scale, input_t, input_inverse_scale, main_grad, use_fast_accum):
    return None


def float8_accumulates(config) -> bool:
    """Whether a torchao Float8LinearConfig's weight gradient can be added into the buffer
    by `Float8AccumulatingMatmul`: dynamic tensorwise scaling of every operand, each operand
    cast the same way for both GEMMs it enters (the tensorwise recipe). Rowwise scaling
    keeps torchao's function (cuBLASLt's rowwise scales are not bound here)."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts = [config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output]
    return (all(c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE
                for c in casts)
            and config.cast_config_input_for_grad_weight == config.cast_config_input
            and config.cast_config_weight_for_grad_input == config.cast_config_weight
            and config.cast_config_grad_output_for_grad_weight == config.cast_config_grad_output
            and not config.pad_inner_dim)


def to_float8(t, dtype, round_scales_to_power_of_2: bool = False):
    """(float8 data, scale) of `t` under torchao's dynamic tensorwise scaling: the scale and
    the saturating cast are torchao's, so the data equal its Float8TrainingTensor's."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(t, dtype, round_scales_to_power_of_2=round_scales_to_power_of_2)
    return to_fp8_saturated(t.to(torch.float32) * scale, dtype), scale


def _to_float8(t, cast, config):
    """`to_float8` as a torchao Float8LinearConfig casts one operand (`cast`)."""
    return to_float8(t, cast.target_dtype, config.round_scales_to_power_of_2)


def _float8_mm(a, a_scale, b, b_scale, out_dtype, use_fast_accum, emulate):
    """(a / a_scale) @ (b / b_scale) as torchao's float8 mm computes it: a row-major, b
    column-major (`torch._scaled_mm`'s layouts), or emulated in fp32 (CPU)."""
    if emulate:
        return torch.mm(a.float() / a_scale, b.float() / b_scale).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


class Float8AccumulatingMatmul(torch.autograd.Function):
    """y = x @ W.T in float8 (torchao's tensorwise recipe), whose backward adds dW into
    `main_grad` in its float8 GEMM and hands autograd an unwritten dW, as
    `AccumulatingMatmul` does. The float8 input is saved for the backward instead of the bf16
    one: under tensorwise scaling its cast for the weight gradient is the same cast."""

    @staticmethod
    def forward(ctx, x, weight, main_grad, config):
        x2d = x.reshape(-1, x.shape[-1])
        x_data, x_scale = _to_float8(x2d, config.cast_config_input, config)
        w_data, w_scale = _to_float8(weight, config.cast_config_weight, config)
        out = _float8_mm(x_data, x_scale, w_data.t(), w_scale, x.dtype, config.gemm_config_output.use_fast_accum,
                         config.emulate)
        ctx.save_for_backward(x_data, x_scale, weight)
        ctx.main_grad, ctx.config, ctx.input_shape = main_grad, config, x.shape  # main_grad: see AccumulatingMatmul
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_data, x_scale, weight = ctx.saved_tensors
        config = ctx.config
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        g_data, g_scale = _to_float8(g2d, config.cast_config_grad_output, config)
        w_data, w_scale = _to_float8(weight, config.cast_config_weight, config)
        grad_x = _float8_mm(g_data, g_scale, w_data.t().contiguous().t(), w_scale, grad_out.dtype,
                            config.gemm_config_grad_input.use_fast_accum, config.emulate)
        # main_grad [out, in] += g.T @ x: both operands with the token dimension contiguous
        _accumulate_float8_op(g_data.t().contiguous(), g_scale.reciprocal(), x_data.t().contiguous(),
                              x_scale.reciprocal(), ctx.main_grad, config.gemm_config_grad_weight.use_fast_accum)
        return grad_x.reshape(ctx.input_shape), torch.empty_like(weight), None, None


def flag_added_gradients(weight) -> None:
    """Set `weight.grad_added_to_main_grad` whenever a gradient reaches the weight's
    accumulator, before DDP's hook on the same node reads it (DDP clears it every step)."""
    node = weight.expand_as(weight).grad_fn.next_functions[0][0]  # the node DDP's hook is on
    node.register_prehook(lambda grads: setattr(weight, "grad_added_to_main_grad", True))


# The extension's two entry points (fp32 and 16-bit buffers): one function serves both.
wgrad_gemm_accum_fp32 = accumulate_weight_gradient
wgrad_gemm_accum_fp16 = accumulate_weight_gradient


def provide() -> None:
    """Make Megatron-Core's linears find this module where they look for Apex's extension
    (a module global they read at call time). Called before a model with the fusion is
    built; an installed Apex is left in place."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
        layers._grad_accum_fusion_available = True
