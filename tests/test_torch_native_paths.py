"""The torch-native spec's faster paths on CPU: FP8 through torchao (emulated), compiled
layers, and the worker environment they need. (Async TP is exact against one process in
test_checkpoints' tp2_sp_overlap layout; CP's lower-right causal SDPA in its cp2 layout.)"""
import json

import pytest
import torch

from gridwright.config.compose import compose_config
from gridwright.megatron_internals.parallel_linear import _matmul, float8_setup
from gridwright.launchers.environment import worker_env


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_matmul_is_float8_and_close(recipe):
    """torchao's float8 matmul, forward and both gradients: e4m3/e5m2 rounding is visible
    (so float8 really ran) and stays at float8's few per cent (so nothing is mis-scaled)."""
    torch.manual_seed(0)
    x = torch.randn(16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(96, 64) * 0.02).to(torch.bfloat16).requires_grad_()
    y, y_ref = _matmul(x, w, float8_setup(recipe, emulate=True)), _matmul(x, w, None)
    g = torch.randn_like(y_ref)
    grads = torch.autograd.grad(y, (x, w), g)
    grads_ref = torch.autograd.grad(y_ref, (x, w), g)
    for got, ref in ((y, y_ref), *zip(grads, grads_ref)):
        assert got.shape == ref.shape
        assert 0.005 < _rel(got, ref) < 0.1


@pytest.mark.slow
def test_compiled_float8_matmul_gives_the_eager_one():
    """The output layer's float8 matmul runs compiled on CUDA (its casts fused); compiled
    (inductor on CPU, emulated float8) it gives eager's output and gradients."""
    from gridwright.megatron_internals.parallel_linear import _compiled_matmul

    torch.manual_seed(0)
    fp8 = float8_setup("tensorwise", emulate=True)
    x = torch.randn(64, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 32) * 0.02).to(torch.bfloat16).requires_grad_()
    y, y_ref = _compiled_matmul()(x, w, fp8), _matmul(x, w, fp8)
    g = torch.randn_like(y_ref)
    for got, ref in zip((y, *torch.autograd.grad(y, (x, w), g)), (y_ref, *torch.autograd.grad(y_ref, (x, w), g))):
        assert _rel(got, ref) < 1e-3  # 0.0 when written; bf16 against float8 differs by ~4 %
    assert _rel(y, _matmul(x, w, None)) > 0.005


def _losses(job):
    return [json.loads(line)["loss"] for line in (job / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchao_fp8_trains_at_tp2_sp(run_launch, tmp_path):
    """precision=fp8_rowwise at TP=2+SP: the summary names the float8 path, and the losses
    follow the bf16 run closely without being equal to it."""
    runs = {}
    for name, precision in (("bf16", ["precision=bf16"]), ("fp8", ["precision=fp8_rowwise"]),
                            ("fp8_out", ["precision=fp8_rowwise", "precision.fp8_output_layer=true"])):
        job = tmp_path / name
        result = run_launch("+experiment=tiny_llama_tp2", "parallel.sp=true", *precision, "tracking=off",
                            "train.steps=4", f"job_dir={job}")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = job
    spec = json.loads((runs["fp8"] / "summary.json").read_text())["layer_spec"]
    assert spec == "local+sdpa+float8_rowwise(torchao, emulated)"
    spec = json.loads((runs["fp8_out"] / "summary.json").read_text())["layer_spec"]
    assert spec == "local+sdpa+float8_rowwise(torchao, emulated)+float8_output_layer"
    bf16, fp8, fp8_out = _losses(runs["bf16"]), _losses(runs["fp8"]), _losses(runs["fp8_out"])
    # float8 logits round differently from the first step on; still within float8's per cent
    assert fp8 != bf16 and fp8_out[0] != fp8[0]
    assert all(abs(a / b - 1) < 0.02 for a, b in zip(fp8, bf16))
    assert all(abs(a / b - 1) < 0.02 for a, b in zip(fp8_out, bf16))


@pytest.mark.slow
def test_compiled_layers_match_eager(run_launch, tmp_path):
    """engine.compile_layers=true (inductor on CPU) gives the eager run's losses."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["engine.compile_layers=true"])):
        job = tmp_path / name
        result = run_launch("cluster.gpus_per_node=1", "tracking=off", "train.steps=4", *extra, f"job_dir={job}",
                            timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = _losses(job)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["layer_spec"] == "local+sdpa+compiled"  # read from the built layers
    # One graph serves every layer: no graph break inside a layer (Megatron-Core's rank-0
    # warning on a missing TP group once broke each row-parallel linear) and no recompile.
    assert summary["compiled_graphs"] == 1
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-5)


def test_fused_kernels_are_on_for_cuda_and_off_on_cpu_unless_asked():
    """engine.fused_kernels=null turns Megatron-Core's SwiGLU fusion on for CUDA only, and
    its cross-entropy fusion too where the weights are bf16 (its backward casts the logits'
    gradient to bf16); true or false decides on either device. TransformerConfig accepts them."""
    from megatron.core.transformer import TransformerConfig

    from gridwright.engines.megatron_model import transformer_config_kwargs
    from gridwright.planning.layout import ParallelLayout

    gpu = ["cluster=h100_x2", "+bench=bench_gpu"]  # bf16
    for overrides, fused in (([], (False, False)), (["engine.fused_kernels=true"], (True, False)),
                             (["engine.fused_kernels=true", "precision=bf16"], (True, True)),
                             (gpu, (True, True)), (gpu + ["precision=fp16"], (True, False)),
                             (gpu + ["engine.fused_kernels=false"], (False, False))):
        cfg = compose_config(overrides)
        kw = transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg), te_available=False)
        assert (kw["bias_activation_fusion"], kw["cross_entropy_loss_fusion"]) == fused, overrides
        kw["use_cpu_initialization"] = True
        tc = TransformerConfig(**kw)
        assert tc.bias_activation_fusion is fused[0] and tc.cross_entropy_fusion_impl == "native"


@pytest.mark.slow
@pytest.mark.parametrize("precision,spec,first,every", [
    ("fp32", "local+sdpa+fused(swiglu)", 1e-6, 1e-5),
    ("bf16", "local+sdpa+fused(swiglu,cross_entropy)", 1e-3, 1e-2)])
def test_fused_kernels_match_the_unfused_run_at_tp2_sp(run_launch, tmp_path, precision, spec, first, every):
    """Megatron-Core's fused SwiGLU (and, in bf16, its vocabulary-parallel cross-entropy,
    which reduces over the vocabulary shards of two ranks), compiled by inductor on CPU,
    follow the unfused run at TP=2+SP: in fp32 to rounding; in bf16 within bf16's rounding."""
    runs = {}
    for name, fused in (("plain", "false"), ("fused", "true")):
        job = tmp_path / name
        result = run_launch("+experiment=tiny_llama_tp2", "parallel.sp=true", f"precision={precision}", "tracking=off",
                            "train.steps=4", f"engine.fused_kernels={fused}", f"job_dir={job}", timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = job
    assert json.loads((runs["fused"] / "summary.json").read_text())["layer_spec"] == spec
    plain, fused = _losses(runs["plain"]), _losses(runs["fused"])
    assert len(fused) == 4 and fused[0] == pytest.approx(plain[0], rel=first)
    assert fused == pytest.approx(plain, rel=every)


def test_worker_connections_follow_tp_overlap():
    """One CUDA connection orders Megatron-Core's SP communication; the symmetric-memory
    overlap needs its copy streams beside compute (8), and the key overrides both."""
    gpu = ["cluster=h100_x2", "+bench=bench_gpu", "parallel.tp=2", "parallel.sp=true"]
    assert worker_env(compose_config(gpu))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert worker_env(compose_config(gpu + ["engine.tp_comm_overlap=true"]))["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert worker_env(compose_config(gpu + ["engine.cuda_device_max_connections=4"]))["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in worker_env(compose_config([]))


@pytest.mark.slow
def test_compiled_layers_all_compile_under_param_gather_overlap(run_launch, tmp_path):
    """DDP's parameter-gather pre-hooks differ per layer, so each layer compiles its own
    graph; past dynamo's default recompile limit (8) layers would silently run eagerly
    (seen on 2 x H200 and here with 10 layers before the limit was raised)."""
    job = tmp_path / "dp2"
    result = run_launch("zero=stage1", "engine.overlap_grad_reduce=true", "engine.overlap_param_gather=true",
                        "engine.compile_layers=true", "model.num_layers=10", "train.steps=3", "tracking=off",
                        f"job_dir={job}", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "recompile_limit" not in result.stdout + result.stderr
    summary = json.loads((job / "summary.json").read_text())
    assert summary["layer_spec"] == "local+sdpa+compiled" and summary["compiled_graphs"] >= 10


def test_cuda_graphs_become_megatron_cores_local_graphs():
    """engine.cuda_graphs=layers asks Megatron-Core for its own per-layer graphs (a CPU
    cannot capture them: the GPU rows are in evaluations/results), and TransformerConfig
    accepts the pair as given."""
    from megatron.core.transformer import TransformerConfig

    from gridwright.engines.megatron_model import transformer_config_kwargs
    from gridwright.planning.layout import ParallelLayout

    base = ["cluster=h100_x2", "+bench=bench_gpu", "parallel.tp=2", "parallel.sp=true"]
    for extra, impl in (([], "none"), (["engine.cuda_graphs=layers"], "local")):
        cfg = compose_config(base + extra)
        kw = transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg), te_available=False)
        assert kw.get("cuda_graph_impl", "none") == impl
        kw["use_cpu_initialization"] = True
        tc = TransformerConfig(**kw)
        assert tc.cuda_graph_impl == impl and tc.cuda_graph_scope == []


def test_graph_safe_rng_states_are_saved_as_tensors():
    """Under CUDA graphs Megatron-Core's RNG tracker holds torch.Generator objects; a
    checkpoint keeps their states as tensors (no pickled objects) and puts them back into
    the same generators, whose numbers then repeat."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from gridwright.engines.megatron_checkpoint import _restore_tracker, _tracker_states

    tracker = CudaRNGStatesTracker()
    generators = {"model-parallel-rng": torch.Generator().manual_seed(1), "data-parallel-rng": torch.Generator().manual_seed(2)}
    tracker.set_states(dict(generators))
    saved = _tracker_states(tracker)
    assert all(type(s) is torch.Tensor for s in saved.values())
    first = {name: torch.rand(3, generator=g) for name, g in generators.items()}
    _restore_tracker(tracker, saved)
    restored = tracker.get_states()
    for name, g in generators.items():
        assert restored[name] is g  # the very generator a graph would have registered
        assert torch.equal(torch.rand(3, generator=g), first[name])
    plain = CudaRNGStatesTracker()  # without graphs: tensor states, set as they are
    plain.set_states({"x": torch.arange(4, dtype=torch.uint8)})
    _restore_tracker(plain, _tracker_states(plain))
    assert torch.equal(plain.get_states()["x"], torch.arange(4, dtype=torch.uint8))
