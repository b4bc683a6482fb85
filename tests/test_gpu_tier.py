"""The GPU tier (`python -m pytest -m gpu`, on a machine with a CUDA GPU and Transformer
Engine): TE imports and computes, a TE-spec run trains, and a TE FP8 run stopped after a
save resumes with the uninterrupted run's losses at every step, under delayed and current
scaling. `python -m gridwright.evaluations.gpu_tier` runs this tier and writes its results
file; there a skip counts as a failure. Elsewhere these tests skip."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from gridwright.runtime.process_tree import run_bounded

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU tier)")
needs_te = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
                              reason="needs CUDA and Transformer Engine (the GPU tier)")

# Small enough for seconds, with every dimension a multiple of 16 (FP8 GEMMs need it).
MODEL = ["model=tiny_llama", "model.hidden_size=256", "model.ffn_hidden_size=768", "model.num_attention_heads=4",
         "model.num_query_groups=2", "train.seq_length=256", "train.micro_batch_size=2", "train.global_batch_size=8",
         "train.warmup_steps=1", "cluster=h100_x1", "tracking=off",
         "engine.layer_spec=transformer_engine"]  # at this size `auto` would give tensorwise FP8 to torchao
RECIPES = {"delayed": "precision=fp8_delayed", "current": "precision=fp8_tensorwise"}


def launch(tmp: Path, job: str, *args, timeout: int = 180) -> tuple[subprocess.CompletedProcess, Path]:
    job_dir = tmp / job
    # TE's deterministic fused attention: a resume can equal the uninterrupted run only so
    env = {**os.environ, "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    result = run_bounded([sys.executable, str(REPO / "launch.py"), *MODEL, f"job_root={tmp / 'jobs'}",
                          f"job_dir={job_dir}", *args], timeout, grace_s=10, cwd=tmp, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result, job_dir


def losses(job: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@needs_te
@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
def test_transformer_engine_linear_computes_in_fp8(recipe):
    """te.Linear under an FP8 recipe: forward near the bf16 product, gradients finite."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    torch.manual_seed(0)
    layer = te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=getattr(recipes, recipe)()):
        y = layer(x)
    y.float().square().sum().backward()
    reference = x.detach().float() @ layer.weight.detach().float().t()
    error = (y.float() - reference).norm() / reference.norm()
    assert 0 < error < 0.1, error  # FP8 rounds (error > 0), but stays near the product
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()


@needs_te
def test_a_transformer_engine_run_trains_in_bf16_and_fp8(tmp_path):
    """The same seed in bf16 and FP8 (delayed scaling): both learn, and end near each other."""
    final = {}
    output = "precision.fp8_output_layer=true"
    for name, *args in (("bf16", "precision=bf16"), ("delayed", RECIPES["delayed"]),
                        ("delayed_output", RECIPES["delayed"], output)):
        result, job = launch(tmp_path, name, *args, "train.steps=20", "train.lr=3e-3")
        spec = json.loads((job / "summary.json").read_text())["layer_spec"]
        assert spec.startswith("transformer_engine"), spec
        assert ("+fp8(delayed" in spec) == (name != "bf16"), spec
        # the output layer outside TE's layers, through torchao's float8 matmul
        assert ("+float8_output_layer(float8_tensorwise(torchao))" in spec) == (output in args), spec
        run = losses(job)
        assert run[max(run)] < run[min(run)] - 0.2, run  # it learns (5.59 -> 5.23 seen in bf16)
        final[name] = run[max(run)]
    assert all(abs(final[n] - final["bf16"]) < 0.05 * final["bf16"] for n in final), final


@needs_te
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_transformer_engine_fp8_run_resumes_exactly(recipe, tmp_path):
    """Saved at step 3 and at step 6 of 8; resumed from step 3 (as after a stop there), the
    run gives the uninterrupted run's losses bit for bit at every later step. Under delayed
    scaling the FP8 scales and amax histories travel in TE's extra state, read safely."""
    steps, ck = 8, tmp_path / "ck"
    _, whole = launch(tmp_path, "whole", RECIPES[recipe], f"train.steps={steps}", f"checkpoint.save={ck}",
                      "checkpoint.save_interval=3")
    reference = losses(whole)
    assert sorted(reference) == list(range(steps))
    saved = json.loads((whole / "summary.json").read_text())
    assert saved["layer_spec"].startswith("transformer_engine+fp8"), saved["layer_spec"]
    pickles = extra_state_pickles(ck / "iter_0000003")
    assert bool(pickles) == (recipe == "delayed"), sorted(pickles)  # current scaling keeps no state
    keep_fixture(recipe, pickles)
    # As a stop after step 3 leaves it: the later iteration removed, `latest` at step 3
    shutil.rmtree(ck / "iter_0000006")
    (ck / "latest").write_text("iter_0000003")
    result, resumed_job = launch(tmp_path, "resumed", RECIPES[recipe], f"train.steps={steps}", f"checkpoint.load={ck}")
    assert "resuming after step 3" in result.stdout, result.stdout[-2000:]
    resumed = losses(resumed_job)
    assert sorted(resumed) == list(range(3, steps))
    assert {s: resumed[s] for s in resumed} == {s: reference[s] for s in resumed}


def extra_state_pickles(iteration: Path) -> dict[str, bytes]:
    """The non-empty TE extra states of one checkpoint: {object name[layer]: pickle bytes}."""
    from gridwright.checkpoints.checkpoint_trust import dcp_objects
    from gridwright.checkpoints.te_extra_state import is_extra_state_key, payload_bytes

    out = {}
    for fqn, _, value in dcp_objects(iteration):
        if not is_extra_state_key(fqn):
            continue
        for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            data = payload_bytes(item)
            if data:
                out[f"{fqn}[{i}]"] = data
    return out


def keep_fixture(recipe: str, pickles: dict[str, bytes]) -> None:
    """GRIDWRIGHT_TE_FIXTURES=DIR: keep one extra state TE wrote (the CPU tests' real file)."""
    where = os.environ.get("GRIDWRIGHT_TE_FIXTURES")
    if where and pickles:
        name = next(k for k in sorted(pickles) if "linear_proj" in k)
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"te_extra_state_{recipe}.pkl").write_bytes(pickles[name])


@needs_te
def test_a_transformer_engine_checkpoint_converts_to_hugging_face_and_back_by_logits(tmp_path, monkeypatch):
    """A TE FP8 run's checkpoint (extra state included) gives the same logits under TE's
    layers (GPU), the torch-native spec (CPU) and, converted, transformers' model (CPU),
    within conversion's tolerance (fp32 compute, TF32 off); converted back, TE's layers give
    the first logits exactly."""
    from gridwright.adapters.verify_logits import hf_logits, megatron_logits
    from gridwright.checkpoints.logits_digest import sample_tokens

    ck, hf, back = tmp_path / "ck", tmp_path / "hf", tmp_path / "back"
    launch(tmp_path, "run", RECIPES["delayed"], "train.steps=4", f"checkpoint.save={ck}", "checkpoint.save_interval=4")
    assert extra_state_pickles(ck / "iter_0000004")  # the FP8 scales travel with the weights
    tokens = sample_tokens(256, 2, 16)
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # full fp32 GEMMs in TE's process too
    te = megatron_logits(ck, tokens, layer_spec="transformer_engine", timeout=120)
    native = megatron_logits(ck, tokens, layer_spec="torch_native", timeout=120)
    for direction, args in (("megatron-to-hf", ["--megatron", ck, "--out", hf]),
                            ("hf-to-megatron", ["--hf", hf, "--out", back])):
        done = run_bounded([sys.executable, "-m", "gridwright.adapters.convert", direction, *map(str, args)], 120,
                           grace_s=10)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    differences = {"torch-native": (te - native).abs().max().item(),
                   "transformers": (te - hf_logits(hf, tokens)).abs().max().item()}
    print("TE logits against", differences)
    assert te.shape == (2, 16, 256)
    assert max(differences.values()) <= 1e-4, differences  # convert --verify's default tolerance
    assert torch.equal(megatron_logits(back, tokens, layer_spec="transformer_engine", timeout=120), te)


@needs_te
def test_packed_documents_train_through_te_thd_attention(tmp_path):
    """Packed documents (THD) on TE's layers: its fused attention and fused rotary kernel
    read each document's bounds on the GPU; the run trains and says it ran TE."""
    result, job = launch(tmp_path, "packed", "precision=bf16", "data.packing=true", "data.doc_lengths.median=48",
                         "train.steps=20", "train.lr=3e-3", "train.micro_batch_size=1", "train.global_batch_size=4")
    summary = json.loads((job / "summary.json").read_text())
    assert summary["layer_spec"].startswith("transformer_engine"), summary["layer_spec"]
    assert (summary.get("attention") or {}).get("backend") == "transformer_engine", summary.get("attention")
    run = losses(job)
    assert run[max(run)] < run[min(run)] - 0.2, run


@needs_te
@pytest.mark.parametrize("precision", ["bf16", "fp8_delayed"])
def test_megatron_fsdp_trains_transformer_engine_layers(precision, tmp_path):
    """ZeRO-3 (Megatron-FSDP) over TE's layers, one micro-batch a step (one data-parallel
    rank with several is refused: it did not learn): the run learns and says it ran TE."""
    result, job = launch(tmp_path, precision, "zero=stage3", f"precision={precision}", "train.steps=20",
                         "train.lr=3e-3", "train.global_batch_size=2")
    summary = json.loads((job / "summary.json").read_text())
    assert summary["layer_spec"].startswith("transformer_engine"), summary["layer_spec"]
    assert ("+fp8(delayed" in summary["layer_spec"]) == (precision != "bf16"), summary["layer_spec"]
    run = losses(job)
    assert run[max(run)] < run[min(run)] - 0.2, run


@needs_te
def test_te_thd_attention_keeps_each_packed_document_to_itself():
    """TE's fused THD attention on the real GPTModel: B's per-token losses do not move when
    document A changes, and do move when the row runs as one sequence (the control)."""
    proc = run_bounded([sys.executable, str(REPO / "tests" / "packed_forward.py"), "--te", "1:1", "2:1", "2:0"], 120,
                       grace_s=10, env={**os.environ, "MASTER_PORT": "29532", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with_a, with_other_a, leaking = (json.loads(line) for line in proc.stdout.strip().splitlines()[-3:])
    start = with_a["b_start"]
    a_moved = max(abs(x - y) for x, y in zip(with_a["losses"][:start], with_other_a["losses"][:start]))
    b_moved = max(abs(x - y) for x, y in zip(with_a["losses"][start:], with_other_a["losses"][start:]))
    b_leaks = max(abs(x - y) for x, y in zip(with_a["losses"][start:], leaking["losses"][start:]))
    print(f"A moved {a_moved:.3g}, B moved {b_moved:.3g}, B as one sequence {b_leaks:.3g}")
    assert a_moved > 1e-3 and b_leaks > 1e-3, (a_moved, b_leaks)
    assert b_moved <= 1e-6, b_moved  # the same kernels on B's tokens; A's values never reach them
