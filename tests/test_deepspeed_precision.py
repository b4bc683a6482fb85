"""bf16 on both engines from the same weights (2 CPU processes, DP=2): the Megatron engine
keeps fp32 main weights in its distributed optimizer, DeepSpeed in its ZeRO optimizer; both
round the loaded weights to bf16 for compute, so their losses agree step by step.

This caught a defect: the Megatron engine started "from" a converted checkpoint kept the
optimizer's fp32 copies of its own random draw, and its first step wrote them back."""
import pytest
from conftest import launch
from test_deepspeed_runs import losses_and_norms, megatron_run_from_hf

BF16 = "precision.params_dtype=bf16"


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    return megatron_run_from_hf(tmp_path_factory.mktemp("bf16"), "llama", BF16)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_runs_of_both_engines_agree_from_the_same_weights(start, stage):
    root, hf, common, (want_loss, want_norm) = start
    job = root / f"zero{stage}"
    result = launch([*common, "engine=deepspeed", f"zero=stage{stage}", f"checkpoint.load={hf}", f"job_dir={job}"],
                    cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss, norm = losses_and_norms(job)
    assert want_loss[-1] < want_loss[0] - 0.3
    # bf16 rounding of different reduction orders: measured within 3e-4 over 6 steps at
    # ZeRO-1. Without the main-weight refresh the Megatron run differed by 3e-2 at step 1.
    assert loss == pytest.approx(want_loss, rel=5e-3)
    assert norm[:5] == pytest.approx(want_norm[:5], rel=2e-2)
