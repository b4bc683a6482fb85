"""engine.gradient_accumulation_fusion: the weight-gradient GEMM adds into DDP's fp32 buffer
itself, through Megatron-Core's linear function (with gridwright.megatron_internals.wgrad_accumulation
standing in for Apex's extension) or through gridwright's AccumulatingMatmul (TP=1, compiled
layers). Checked on CPU: the buffer holds the same sum over micro-batches as autograd's
gradients, DDP's hook does not add a second time, and whole runs (TP=2+SP; DP=2 compiled,
with the overlapped reduction and tied embeddings) follow the unfused run."""
import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gridwright.config.compose import compose_config
from gridwright.engines.megatron_model import gradient_accumulation_fusion
from gridwright.megatron_internals.wgrad_accumulation import accumulate_weight_gradient
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


def _worker(rank, port, params_dtype, gridwright_linears, out):
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
            (x.float() @ weights[0].t() @ weights[1].t()).pow(2).sum().backward()
        model.finish_grad_sync()
        out["added"] = [p.grad_added_to_main_grad for p in module.parameters()]
        out["buffer"] = [p.main_grad.clone() for p in module.parameters()]
        out["reference"] = [w.grad for w in weights]
        ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("gridwright_linears", [False, True], ids=["megatron_function", "accumulating_matmul"])
@pytest.mark.parametrize("params_dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linears_accumulate_into_ddp_buffers(params_dtype, tolerance, gridwright_linears):
    """Column- and row-parallel linears under Megatron-Core's DDP with the overlapped reduction,
    three micro-batches: through Megatron-Core's function (with `provide`'s GEMM) and through
    gridwright's `AccumulatingMatmul` (both of its linears routed), each gradient is marked as
    added and the fp32 buffer holds autograd's sum (in fp32), to rounding in fp32 and to
    bf16's in bf16."""
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), params_dtype, gridwright_linears, out), nprocs=1, join=True)
    assert out["routed"] == (2 if gridwright_linears else 0)
    assert out["added"] == [True, True]
    for got, ref in zip(out["buffer"], out["reference"]):
        assert got.dtype == torch.float32
        assert ((got - ref).norm() / ref.norm()).item() < tolerance


def test_the_default_is_cuda_and_megatron_ddp_only():
    """None: on for CUDA under Megatron-Core's DDP and distributed optimizer; off on CPU, under
    Megatron-FSDP and on DeepSpeed (an explicit true there is refused: test_validation)."""
    gpu = ["cluster=h100_x2", "+experiment=bench_gpu"]
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
def test_the_spec_names_the_fusion_only_where_a_linear_fuses(run_launch, tmp_path):
    """Float8 linears do not fuse: with the output layer in float8 too, nothing does, and the
    spec does not claim it; with the output layer in bf16 that layer fuses."""
    specs = {}
    for output_layer in ("true", "false"):
        job = tmp_path / output_layer
        result = run_launch("precision=fp8_tensorwise", "precision.fp8_backend=torchao",
                            f"precision.fp8_output_layer={output_layer}", "engine.gradient_accumulation_fusion=true",
                            "train.steps=3", "tracking=off", f"job_dir={job}", timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        specs[output_layer] = json.loads((job / "summary.json").read_text())["layer_spec"]
    assert "wgrad_accumulation" not in specs["true"] and "float8_output_layer" in specs["true"]
    assert "wgrad_accumulation" in specs["false"]
