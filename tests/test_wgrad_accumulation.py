"""engine.gradient_accumulation_fusion: the weight-gradient GEMM adds into DDP's fp32 buffer
itself, through Megatron-Core's linear function (with gridwright.megatron_internals.wgrad_accumulation
standing in for Apex's extension) or through gridwright's AccumulatingMatmul (TP=1, compiled
layers), and in float8 through Float8AccumulatingMatmul (torchao's tensorwise recipe; its
GEMM is cuBLASLt's on CUDA, torch_internals.float8_gemm, and emulated in fp32 on CPU). Checked on
CPU: the buffer holds the same sum over micro-batches as autograd's gradients, DDP's hook
does not add a second time, float8 forwards and input gradients equal torchao's, and whole
runs (TP=2+SP; DP=2 compiled, with the overlapped reduction and tied embeddings) follow the
unfused run."""
import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gridwright.config.compose import compose_config
from gridwright.engines.megatron_model import gradient_accumulation_fusion
from gridwright.megatron_internals.parallel_linear import float8_setup
from gridwright.megatron_internals.wgrad_accumulation import (
    Float8AccumulatingMatmul,
    accumulate_weight_gradient,
    float8_accumulates,
)
from gridwright.torch_internals.float8_gemm import accumulate_float8_gemm
from gridwright.runtime.loopback import free_port


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_adds_into_the_buffer(dtype):
    """main_grad += dy.T @ x, for fp32 inputs and for bf16 inputs into an fp32 buffer."""
    torch.manual_seed(0)
    x, dy = torch.randn(24, 16).to(dtype), torch.randn(24, 8).to(dtype)
    start = torch.randn(8, 16)
    buffer = start.clone()
    accumulate_weight_gradient(x, dy, buffer)
    expected = start + dy.float().t() @ x.float()
    assert torch.allclose(buffer, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(buffer, start)


def test_the_float8_gemm_adds_the_dequantized_product():
    """out += (a · sa) @ (b · sb).T for float8 operands (e5m2 and e4m3, as a weight gradient's)."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 32).to(torch.float8_e5m2), torch.randn(16, 32).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    start = torch.randn(8, 16)
    out = start.clone()
    accumulate_float8_gemm(a, sa, b, sb, out)
    expected = start + (a.float() * 0.5) @ (b.float() * 0.25).t()
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6) and not torch.equal(out, start)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's GEMM needs CUDA (run on a GPU machine)")
@pytest.mark.parametrize("offset", [0, 16, 1], ids=["aligned", "16_bytes", "4_bytes_fallback"])
def test_the_cublaslt_gemm_adds_what_scaled_mm_computes(offset):
    """On CUDA, M, N and K all different: the in-place GEMM (a buffer view at a 256- or
    16-byte aligned address) and the fallback (4-byte aligned) add the product
    `torch._scaled_mm` computes in fp32, and leave the rest of the buffer alone."""
    torch.manual_seed(0)
    a = torch.randn(96, 256, device="cuda").to(torch.float8_e5m2)
    b = torch.randn(160, 256, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    storage = torch.randn(96 * 160 + 64, device="cuda")
    out = storage[offset:offset + 96 * 160].view(96, 160)
    before = storage.clone()
    accumulate_float8_gemm(a, sa, b, sb, out)
    product = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    expected = before[offset:offset + 96 * 160].view(96, 160) + product
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-4)
    untouched = torch.ones_like(storage, dtype=torch.bool)
    untouched[offset:offset + 96 * 160] = False
    assert torch.equal(storage[untouched], before[untouched])


def test_only_the_tensorwise_recipe_accumulates_in_float8():
    assert float8_accumulates(float8_setup("tensorwise", emulate=True)[0])
    assert not float8_accumulates(float8_setup("rowwise", emulate=True)[0])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_float8_matmul_is_torchaos_with_its_weight_gradient_in_the_buffer(compiled):
    """Against torchao's own float8 function (emulated): the same output and input gradient,
    bit for bit; the weight gradient added into the buffer, where torchao's is rounded to
    bf16 first (so they differ by bf16's rounding); compiled the same as eager."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    config, mm_config = float8_setup("tensorwise", emulate=True)
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    dy = torch.randn(2, 32, 48, dtype=torch.bfloat16)
    start = torch.randn(48, 64)

    def apply(x, w, main_grad):
        return Float8AccumulatingMatmul.apply(x, w, main_grad, config)

    fused_x, fused_w, buffer = x.clone().requires_grad_(), w.clone().requires_grad_(), start.clone()
    # compiled as one graph: a break would raise here
    fused_out = (torch.compile(apply, fullgraph=True) if compiled else apply)(fused_x, fused_w, buffer)
    fused_out.backward(dy)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = matmul_with_hp_or_float8_args.apply(ref_x, ref_w.t(), mm_config, config)
    out.backward(dy)
    assert torch.equal(fused_out, out)
    assert torch.equal(fused_x.grad, ref_x.grad)
    added, reference = buffer - start, ref_w.grad.float()
    assert ((added - reference).norm() / reference.norm()).item() < 4e-3
    assert not torch.equal(added, reference)  # the buffer's sum was never rounded to bf16


def _worker(rank, port, params_dtype, gridwright_linears, out, float8=False):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from gridwright.megatron_internals.cpu_compat import cpu_compat
    from gridwright.megatron_internals.parallel_linear import (
        GridwrightColumnParallelLinear,
        GridwrightRowParallelLinear,
        accumulate_weight_gradients_in_gemm,
    )
    from gridwright.megatron_internals.wgrad_accumulation import provide

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with cpu_compat():
        ps.initialize_model_parallel()
        provide()
        bf16 = params_dtype == torch.bfloat16
        tcfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=True, params_dtype=params_dtype, bf16=bf16)
        tcfg.gridwright_float8 = float8_setup("tensorwise", emulate=True) if float8 else None
        torch.manual_seed(0)
        init = torch.nn.init.normal_
        column_class, row_class = ((GridwrightColumnParallelLinear, GridwrightRowParallelLinear) if gridwright_linears
                                   else (ColumnParallelLinear, RowParallelLinear))
        column = column_class(16, 32, config=tcfg, init_method=init, bias=False, gather_output=False)
        row = row_class(32, 16, config=tcfg, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True)
        module = torch.nn.ModuleList([column, row])
        weights = [p.detach().clone().float().requires_grad_() for p in module.parameters()]
        # the overlapped reduction waits for every parameter's hook: a skipped hook would hang it
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
        model = DistributedDataParallel(tcfg, ddp_config, module)
        out["routed"] = accumulate_weight_gradients_in_gemm(model)
        model.zero_grad_buffer()
        # three micro-batches into one buffer, every forward before any backward (a pipeline's
        # warm-up): the buffer changes between a micro-batch's forward and its backward
        xs = [torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(b)).to(params_dtype) for b in range(3)]
        losses = [row(column(x)[0])[0].float().pow(2).sum() for x in xs]
        for batch, loss in enumerate(losses):
            with model.no_sync() if batch < 2 else contextlib.nullcontext():
                loss.backward()
        for x in xs:
            if float8:  # torchao's own float8 function (its weight gradients in fp32 here)
                from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

                config, mm_config = tcfg.gridwright_float8
                hidden = matmul_with_hp_or_float8_args.apply(x.float(), weights[0].t(), mm_config, config)
                y = matmul_with_hp_or_float8_args.apply(hidden, weights[1].t(), mm_config, config)
            else:
                y = x.float() @ weights[0].t() @ weights[1].t()
            y.pow(2).sum().backward()
        model.finish_grad_sync()
        out["added"] = [p.grad_added_to_main_grad for p in module.parameters()]
        out["buffer"] = [p.main_grad.clone() for p in module.parameters()]
        out["reference"] = [w.grad for w in weights]
        ps.destroy_model_parallel()
    dist.destroy_process_group()


SLOW = pytest.mark.slow  # each case starts Megatron-Core's DDP in a process (8-10 s): one stays in the fast tier


@pytest.mark.parametrize("gridwright_linears,float8,params_dtype,tolerance", [
    pytest.param(False, False, torch.float32, 1e-5, marks=SLOW), (False, False, torch.bfloat16, 2e-2),
    pytest.param(True, False, torch.float32, 1e-5, marks=SLOW), pytest.param(True, False, torch.bfloat16, 2e-2, marks=SLOW),
    # the float8 reference runs in fp32 (bf16 weights would cast to other float8 data)
    pytest.param(True, True, torch.float32, 1e-5, marks=SLOW)],
    ids=["megatron_function-fp32", "megatron_function-bf16", "accumulating_matmul-fp32", "accumulating_matmul-bf16",
         "float8_accumulating_matmul-fp32"])
def test_linears_accumulate_into_ddp_buffers(params_dtype, tolerance, gridwright_linears, float8):
    """Column- and row-parallel linears under Megatron-Core's DDP with the overlapped reduction,
    three micro-batches: through Megatron-Core's function (with `provide`'s GEMM) and through
    gridwright's `AccumulatingMatmul` or `Float8AccumulatingMatmul` (both of its linears
    routed), each gradient is marked as added and the fp32 buffer holds autograd's sum (in
    fp32; torchao's float8 function's for float8), to rounding in fp32 and to bf16's in bf16."""
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), params_dtype, gridwright_linears, out, float8), nprocs=1, join=True)
    assert out["routed"] == (2 if gridwright_linears else 0)
    assert out["added"] == [True, True]
    for got, ref in zip(out["buffer"], out["reference"]):
        assert got.dtype == torch.float32
        assert ((got - ref).norm() / ref.norm()).item() < tolerance


def test_the_default_is_cuda_and_megatron_ddp_only():
    """None: on for CUDA under Megatron-Core's DDP and distributed optimizer; off on CPU, under
    Megatron-FSDP and on DeepSpeed (an explicit true there is refused: test_validation)."""
    gpu = ["cluster=h100_x2", "+bench=bench_gpu"]
    assert gradient_accumulation_fusion(compose_config(gpu))
    assert gradient_accumulation_fusion(compose_config(gpu + ["zero=stage1"]))
    assert not gradient_accumulation_fusion(compose_config(gpu + ["zero=stage3"]))
    assert not gradient_accumulation_fusion(compose_config(gpu + ["engine=deepspeed", "zero=stage1"]))
    assert not gradient_accumulation_fusion(compose_config(gpu + ["engine.gradient_accumulation_fusion=false"]))
    assert not gradient_accumulation_fusion(compose_config([]))
    assert gradient_accumulation_fusion(compose_config(["engine.gradient_accumulation_fusion=true"]))


def _losses(job):
    return [json.loads(line)["loss"] for line in (job / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["+experiment=tiny_llama_tp2", "parallel.sp=true"],
    ["+experiment=tiny_llama_pp2", "parallel.vpp=2"],
    ["cluster=laptop", "zero=stage1", "engine.overlap_grad_reduce=true", "model.tie_embeddings=true",
     "engine.compile_layers=true"]],
    ids=["tp2_sp", "pp2_vpp2", "dp2_overlap_tied_compiled"])
def test_fused_runs_follow_the_unfused_run(run_launch, tmp_path, layout):
    """Four steps of two micro-batches per rank in fp32, fused against unfused: the same
    losses to rounding, the summary names the fusion, and compiled layers stay one graph
    (TP=2+SP runs Megatron-Core's function; PP=2 with VPP=2, whose warm-up runs forwards
    before backwards, and DP=2 run gridwright's AccumulatingMatmul)."""
    runs = {}
    for fused in ("false", "true"):
        job = tmp_path / fused
        result = run_launch(*layout, "precision=fp32", "tracking=off", "train.steps=4", "train.global_batch_size=8",
                            f"engine.gradient_accumulation_fusion={fused}", f"job_dir={job}", timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[fused] = job
    assert "wgrad_accumulation" in json.loads((runs["true"] / "summary.json").read_text())["layer_spec"]
    assert "wgrad_accumulation" not in json.loads((runs["false"] / "summary.json").read_text())["layer_spec"]
    graphs = {k: json.loads((job / "summary.json").read_text()).get("compiled_graphs") for k, job in runs.items()}
    assert graphs["true"] == graphs["false"], graphs
    plain, fused = _losses(runs["false"]), _losses(runs["true"])
    assert len(fused) == 4 and fused == pytest.approx(plain, rel=1e-5)


@pytest.mark.slow
def test_float8_runs_fuse_under_the_tensorwise_recipe_only(run_launch, tmp_path):
    """Float8 everywhere (the output layer too), fused against unfused: under the tensorwise
    recipe every linear fuses, the spec says so, and the losses follow the unfused run to the
    rounding the unfused run adds (its weight gradients are rounded to bf16 before they reach
    the buffer); under the rowwise recipe no linear fuses, and the spec does not claim it;
    with the output layer tied to the embedding the layers still fuse."""
    runs = {}
    for name, recipe, fused, more in (("tensorwise", "fp8_tensorwise", "true", []),
                                      ("unfused", "fp8_tensorwise", "false", []),
                                      ("rowwise", "fp8_rowwise", "true", []),
                                      # the output layer holds no weight of its own: not routed
                                      ("tied", "fp8_tensorwise", "true", ["model.tie_embeddings=true"])):
        job = tmp_path / name
        result = run_launch(f"precision={recipe}", "precision.fp8_backend=torchao", "precision.fp8_output_layer=true",
                            f"engine.gradient_accumulation_fusion={fused}", "train.steps=4", "tracking=off",
                            f"job_dir={job}", *more, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = job
    specs = {name: json.loads((job / "summary.json").read_text())["layer_spec"] for name, job in runs.items()}
    assert "wgrad_accumulation" in specs["tensorwise"] and "float8_output_layer" in specs["tensorwise"]
    assert "wgrad_accumulation" not in specs["unfused"]
    assert "wgrad_accumulation" not in specs["rowwise"] and "float8_output_layer" in specs["rowwise"]
    assert "wgrad_accumulation" in specs["tied"]
    fused, plain = _losses(runs["tensorwise"]), _losses(runs["unfused"])
    assert len(fused) == 4 and fused[0] == plain[0] and fused == pytest.approx(plain, rel=1e-3)
