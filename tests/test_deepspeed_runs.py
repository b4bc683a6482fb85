"""The DeepSpeed engine: a Hugging Face Llama under ZeRO on 2 CPU processes."""
import json

import pytest


def run(run_launch, tmp_path, stage, name):
    result = run_launch("engine=deepspeed", f"zero=stage{stage}", "train.steps=6", "tracking=off",
                        f"job_dir={tmp_path / name}", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(l)["loss"] for l in lines], json.loads((tmp_path / name / "summary.json").read_text())


def test_zero_stages_give_the_same_losses(run_launch, tmp_path):
    """Sharding changes where states live, not the mathematics: ZeRO-1 and ZeRO-3 agree."""
    z1, summary = run(run_launch, tmp_path, 1, "z1")
    z3, _ = run(run_launch, tmp_path, 3, "z3")
    assert z1[0] == pytest.approx(5.55, abs=0.05)
    assert len(z1) == 6 and z1[-1] < z1[0]
    assert z3 == pytest.approx(z1, abs=1e-4)
    assert summary["placement_verified"] is True and summary["layer_spec"] == "huggingface"
