"""The DeepSpeed engine against the Megatron engine: the same weights, data and schedule
(fp32, 2 CPU processes, DP=2) give the same loss at every step, for every ZeRO stage
(Mixtral: test_deepspeed_mixtral.py), and ZeRO-1/2 over Megatron-Core TP=2 (with and
without SP) follow the Megatron engine's run of the same layout."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launch

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 20


def losses_and_norms(job: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(l) for l in (job / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def megatron_run_from_hf(root: Path, kind: str, *overrides) -> tuple:
    """A random Hugging Face model, the same weights converted for Megatron-Core, and the
    Megatron engine's run from them."""
    from gridwright.adapters.tiny_models import make_tiny_model

    hf = make_tiny_model(kind, root / f"tiny_{kind}_parity")
    converted = subprocess.run([sys.executable, "-m", "gridwright.adapters.convert", "hf-to-megatron", "--hf", str(hf),
                                "--out", str(root / "ck")], capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr[-3000:]
    common = [f"hydra.searchpath=[file://{root / 'ck'}]", f"model=tiny_{kind}_parity", "tracking=off",
              f"train.steps={STEPS}", *overrides]
    result = launch([*common, f"checkpoint.load={root / 'ck'}", f"job_dir={root / 'megatron'}"], cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, hf, common, losses_and_norms(root / "megatron")


def deepspeed_run_from_hf(start: tuple, name: str, *overrides, timeout=600) -> tuple[list[float], list[float]]:
    """The DeepSpeed engine's run from the Hugging Face folder of `start` (a
    megatron_run_from_hf result): its losses and gradient norms."""
    root, hf, common, _ = start
    job = root / name
    result = launch([*common, "engine=deepspeed", *overrides, f"checkpoint.load={hf}", f"job_dir={job}"],
                    cwd=root, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses_and_norms(job)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    return megatron_run_from_hf(tmp_path_factory.mktemp("parity"), "llama")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_follows_the_megatron_engine_step_by_step(start, stage):
    root, hf, common, (want_loss, want_norm) = start
    loss, norm = deepspeed_run_from_hf(start, f"zero{stage}", f"zero=stage{stage}")
    job = root / f"zero{stage}"
    assert len(loss) == STEPS and want_loss[-1] < want_loss[0] - 0.5  # it learns, and so must both
    assert loss == pytest.approx(want_loss, rel=1e-3)
    assert norm == pytest.approx(want_norm, rel=1e-3)  # clipping sees the same gradient norm
    summary = json.loads((job / "summary.json").read_text())
    # ZeRO-3 gathers whole decoder layers (zero.stage3_leaf_layers, its default), and says so
    spec = "huggingface+z3_leaf_layers" if stage == 3 else "huggingface"
    assert summary["placement_verified"] is True and summary["layer_spec"] == spec


def test_full_recompute_follows_the_megatron_engine(start):
    """train.recompute=full on the Hugging Face model (gradient checkpointing of every layer)
    changes memory, not numbers."""
    want_loss, want_norm = start[3]
    loss, norm = deepspeed_run_from_hf(start, "zero2_recompute", "zero=stage2", "train.recompute=full")
    summary = json.loads((start[0] / "zero2_recompute" / "summary.json").read_text())
    assert summary["layer_spec"] == "huggingface+recompute"  # the model's own gradient-checkpointing flag
    assert loss == pytest.approx(want_loss, rel=1e-3)
    assert norm == pytest.approx(want_norm, rel=1e-3)


def test_a_default_run_starts_from_megatrons_initialisation(run_launch, tmp_path):
    """Without initial weights the DeepSpeed engine draws them by Megatron-Core's rules
    (residual-output projections scaled down), not transformers' N(0, 0.02) everywhere."""
    result = run_launch("engine=deepspeed", "zero=stage1", "train.steps=20", "tracking=off",
                        f"job_dir={tmp_path / 'ds'}", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss, _ = losses_and_norms(tmp_path / "ds")
    assert loss[0] == pytest.approx(5.55, abs=0.05)
    assert loss[-1] < 4.6  # transformers' initialisation left it at 5.17 (Megatron engine: 3.88)


TP2_DP2 = ["parallel.tp=2", "cluster.gpus_per_node=4", "cluster.nvlink_domain_size=4", "tracking=off",
           "train.steps=10"]


def megatron_tp2_dp2_run(root: Path, sp: bool) -> tuple:
    layout = [*TP2_DP2, f"parallel.sp={str(sp).lower()}"]
    result = launch([*layout, "zero=stage1", f"job_dir={root / 'megatron'}"], cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, layout, losses_and_norms(root / "megatron")


@pytest.fixture(scope="module")
def megatron_tp2_dp2(tmp_path_factory):
    return megatron_tp2_dp2_run(tmp_path_factory.mktemp("tp2"), sp=False)


def deepspeed_follows(megatron_run: tuple, stage: int) -> None:
    root, layout, (want_loss, want_norm) = megatron_run
    job = root / f"deepspeed{stage}"
    result = launch([*layout, "engine=deepspeed", f"zero=stage{stage}", f"job_dir={job}"], cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss, norm = losses_and_norms(job)
    assert want_loss[-1] < want_loss[0] - 0.4
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert norm == pytest.approx(want_norm, rel=1e-5)
    summary = json.loads((job / "summary.json").read_text())
    assert summary["placement_verified"] is True and summary["layer_spec"] == "local+sdpa"
    ranks = [json.loads((job / "ranks" / f"rank_{r:05d}.json").read_text()) for r in range(4)]
    assert [r["groups"]["tp"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # Megatron-Core's groups
    assert [r["groups"]["dp"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_megatron_tensor_parallelism_follows_the_megatron_engine(megatron_tp2_dp2, stage):
    """TP=2 x DP=2: DeepSpeed partitions the optimizer over Megatron-Core's DP group and
    takes the gradient norm over its TP shards (the mpu adapter) - same losses and norms."""
    deepspeed_follows(megatron_tp2_dp2, stage)


def test_sequence_parallelism_under_zero_follows_the_megatron_engine(tmp_path):
    """TP=2+SP x DP=2 under ZeRO-1: the norm weights' gradients, partial on each TP rank,
    are summed over TP before DeepSpeed reduces them (without it: 6 of 10 losses off)."""
    deepspeed_follows(megatron_tp2_dp2_run(tmp_path, sp=True), 1)


def test_zero_over_tensor_parallelism_starts_from_a_converted_checkpoint(start):
    """DeepSpeed over Megatron-Core TP=2 (+SP) x DP=2 from the converted checkpoint's weights
    follows the Megatron engine's DP=2 run from the same checkpoint."""
    root, hf, common, (want_loss, want_norm) = start
    job = root / "deepspeed_tp2_sp"
    result = launch([*common, "engine=deepspeed", "zero=stage1", "parallel.tp=2", "parallel.sp=true",
                     "cluster.gpus_per_node=4", "cluster.nvlink_domain_size=4", f"checkpoint.load={root / 'ck'}",
                     f"job_dir={job}"], cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss, norm = losses_and_norms(job)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert norm == pytest.approx(want_norm, rel=1e-5)
