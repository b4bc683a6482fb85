"""DeepSpeed engine checkpoints: exact resume after SIGKILL, conversion to Hugging Face and
Megatron-Core checked against the training engine's own logits, and every refusal."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, launch, sigkill_after_save

pytestmark = pytest.mark.slow  # every test here starts processes

DS = ["engine=deepspeed", "tracking=off", "train.warmup_steps=1"]


def losses(job: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (job / "metrics.jsonl").read_text().splitlines())}


def run(root: Path, *overrides, timeout=600) -> subprocess.CompletedProcess:
    result = launch([*DS, *overrides], cwd=root, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridwright.adapters.convert", *args], capture_output=True,
                          text=True, timeout=600)


def refusal(root: Path, *overrides) -> str:
    result = launch([*DS, *overrides], cwd=root)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return result.stderr


def test_sigkill_during_saves_then_resume_matches_uninterrupted(tmp_path):
    steps = 16
    run(tmp_path, "zero=stage2", f"train.steps={steps}", f"job_dir={tmp_path / 'reference'}")
    reference = losses(tmp_path / "reference")
    ck = tmp_path / "ck"
    cmd = [sys.executable, str(REPO / "launch.py"), *DS, "zero=stage2", f"train.steps={steps}",
           f"checkpoint.save={ck}", "checkpoint.save_interval=1", f"job_dir={tmp_path / 'killed'}"]
    saved = sigkill_after_save(cmd, tmp_path, ck, 5)
    assert not (tmp_path / "killed" / "summary.json").exists(), "the run finished before it could be killed"
    assert 5 <= saved < steps

    result = run(tmp_path, "zero=stage2", f"train.steps={steps}", f"checkpoint.load={ck}", f"checkpoint.save={ck}",
                 f"job_dir={tmp_path / 'resumed'}")
    assert f"checkpoint  loaded {ck / f'iter_{saved:07d}'} in " in result.stdout
    assert f"; resuming after step {saved}" in result.stdout
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(saved, steps))
    assert resumed == {s: reference[s] for s in resumed}  # bit-identical

    # A shard cut short is found before any process starts.
    latest = ck / (ck / "latest").read_text().strip()
    shard = latest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    err = refusal(tmp_path, "zero=stage2", f"train.steps={steps + 4}", f"checkpoint.load={ck}")
    assert f"the latest checkpoint {latest} is damaged: {shard} has 1000 bytes, not the " in err
    assert f"The newest intact checkpoint is iter_{saved:07d}: set checkpoint.fallback=true" in err


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_at_another_data_parallel_size_through_the_universal_checkpoint(tmp_path, stage):
    """Saved at DP=2 after 6 of 12 steps, resumed at DP=1 (same global batch): the losses
    follow the uninterrupted DP=2 run. ZeRO-3 needs gridwright's repair of DeepSpeed's
    universal load (without it: 1.2e-5 apart, the no-decay group decayed)."""
    zero, steps = f"zero=stage{stage}", "train.steps=12"
    ck = tmp_path / "ck"
    run(tmp_path, zero, steps, f"checkpoint.save={ck}", "checkpoint.save_interval=6", f"job_dir={tmp_path / 'dp2'}")
    reference = losses(tmp_path / "dp2")
    halfway = tmp_path / "halfway"  # the root as it was after step 6
    halfway.mkdir()
    subprocess.run(["cp", "-a", str(ck / "iter_0000006"), str(halfway)], check=True)
    (halfway / "latest").write_text("iter_0000006\n")
    result = run(tmp_path, zero, steps, "cluster.gpus_per_node=1", f"checkpoint.load={halfway}",
                 f"job_dir={tmp_path / 'dp1'}")
    assert "saved at another data-parallel size: converted to DeepSpeed's universal form" in result.stdout
    resumed = losses(tmp_path / "dp1")
    assert sorted(resumed) == list(range(6, 12))
    assert [resumed[s] for s in range(6, 12)] == pytest.approx([reference[s] for s in range(6, 12)], rel=2e-6)
    assert sorted(p.name for p in halfway.iterdir()) == ["iter_0000006", "latest"]  # the saved root is untouched


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """A ZeRO-3 run's checkpoint: its weights exist only as the ranks' partitions."""
    root = tmp_path_factory.mktemp("zero3")
    run(root, "zero=stage3", "train.steps=4", f"checkpoint.save={root / 'ck'}", f"job_dir={root / 'job'}")
    return root, root / "ck"


def to_hf_verified(ck: Path, out: Path, stage: int) -> None:
    hf = convert("deepspeed-to-hf", "--deepspeed", str(ck), "--out", str(out), "--verify")
    assert hf.returncode == 0, hf.stderr[-3000:]
    assert "against the DeepSpeed engine's own forward at save (fp32) (ok" in hf.stdout
    chatter = ("Setting accelerator to CPU", "Processing zero checkpoint", "Detected checkpoint of type",
               "Reconstructed", "Loading checkpoint shards", "Parsing checkpoint created")  # DeepSpeed's own
    assert not [c for c in chatter if c in hf.stdout + hf.stderr], hf.stdout + hf.stderr
    record = json.loads((out / "conversion.json").read_text())
    assert record["verify"]["max_abs_diff"] <= 1e-4 and record["source_settings"]["zero_stage"] == stage


def test_without_zero_the_module_state_converts(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, "zero=stage0", "train.steps=4", f"checkpoint.save={ck}", f"job_dir={tmp_path / 'job'}")
    to_hf_verified(ck, tmp_path / "hf", 0)


def test_zero3_partitions_convert_to_hugging_face_and_megatron(zero3, tmp_path):
    _, ck = zero3
    to_hf_verified(ck, tmp_path / "hf", 3)
    mg = convert("deepspeed-to-megatron", "--deepspeed", str(ck), "--out", str(tmp_path / "mg"), "--tp", "2", "--verify")
    assert mg.returncode == 0, mg.stderr[-3000:]
    assert "against the DeepSpeed engine's own forward at save (fp32) (ok" in mg.stdout  # the way through HF
    assert "at TP=2 PP=1 EP=1 (ok" in mg.stdout
    record = json.loads((tmp_path / "mg" / "conversion.json").read_text())
    assert record["direction"] == "deepspeed-to-megatron" and record["source"] == str((ck / "iter_0000004").resolve())
    assert record["verify"]["hf_to_megatron"]["max_abs_diff"] <= 1e-4
    assert not list(tmp_path.glob(".mg.*")), "the temporary Hugging Face folder was left behind"


def test_a_conversion_that_does_not_reproduce_the_saved_logits_publishes_nothing(zero3, tmp_path):
    _, ck = zero3
    src = ck / "iter_0000004"
    broken = tmp_path / "ck" / "iter_0000004"
    broken.parent.mkdir()
    subprocess.run(["cp", "-r", str(src), str(broken)], check=True)
    manifest = json.loads((broken / "gridwright_deepspeed.json").read_text())
    manifest["logits_digest"]["logsumexp"][3] += 0.01  # the model that was saved, seen 0.01 off
    (broken / "gridwright_deepspeed.json").write_text(json.dumps(manifest))
    result = convert("deepspeed-to-hf", "--deepspeed", str(broken), "--out", str(tmp_path / "hf"), "--verify")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "differ from the saved model's by 1.000e-02" in result.stderr
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.*"))


def test_refusals_before_anything_starts(zero3, tmp_path):
    root, ck = zero3
    steps = "train.steps=8"
    err = refusal(tmp_path, "zero=stage1", steps, f"checkpoint.load={ck}")
    assert "was saved by DeepSpeed with other settings: zero_stage=1 (checkpoint: 3)" in err
    err = refusal(tmp_path, "zero=stage3", steps, "cluster.gpus_per_node=1", "zero.offload_optimizer=true",
                  f"checkpoint.load={ck}")
    assert "dp=1 (checkpoint: 2), offload_optimizer=True (checkpoint: False)" in err
    assert "only the data parallel size may change" in err
    err = refusal(tmp_path, "zero=stage3", steps, "checkpoint.weights_only=true", f"checkpoint.load={ck}")
    assert "engine=deepspeed resumes its checkpoints whole" in err and "deepspeed-to-hf" in err
    megatron = launch(["tracking=off", steps, f"checkpoint.load={ck}"], cwd=tmp_path)
    assert megatron.returncode == 2 and "holds a deepspeed checkpoint, which engine=megatron cannot resume" \
        in megatron.stderr and "deepspeed-to-megatron" in megatron.stderr
    # A Megatron engine checkpoint is not resumed by DeepSpeed.
    run(tmp_path, "engine=megatron", "train.steps=2", f"checkpoint.save={tmp_path / 'mck'}",
        f"job_dir={tmp_path / 'mjob'}")
    err = refusal(tmp_path, "zero=stage1", steps, f"checkpoint.load={tmp_path / 'mck'}")
    assert "holds a megatron checkpoint, which engine=deepspeed cannot resume" in err
