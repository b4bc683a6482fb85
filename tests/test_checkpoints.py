"""Megatron-Core checkpoints: exact resume after SIGKILL, and resharding onto other layouts."""
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import REPO, launch, sigkill_after_save

pytestmark = pytest.mark.slow  # every test here starts processes


def losses(job_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def train(run_launch, tmp_path, name, *overrides):
    job = tmp_path / name
    result = run_launch("tracking=off", f"job_dir={job}", "train.warmup_steps=1", *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return losses(job)


def test_sigkill_during_saves_then_resume_matches_uninterrupted(run_launch, tmp_path):
    steps = 40
    reference = train(run_launch, tmp_path, "reference", f"train.steps={steps}")

    ck = tmp_path / "ck"
    job = tmp_path / "killed"
    cmd = [sys.executable, str(REPO / "launch.py"), "tracking=off", f"train.steps={steps}", "train.warmup_steps=1",
           f"checkpoint.save={ck}", "checkpoint.save_interval=1", f"job_dir={job}"]
    # Saving every step, most of the run's time is inside a save: kill it there.
    saved = sigkill_after_save(cmd, tmp_path, ck, 5, timeout=180)
    assert not (job / "summary.json").exists(), "the run finished before it could be killed"
    assert 5 <= saved < steps

    job = tmp_path / "resumed"
    result = run_launch("tracking=off", f"job_dir={job}", "train.warmup_steps=1", f"train.steps={steps}",
                        f"checkpoint.load={ck}", f"checkpoint.save={ck}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    resumed = losses(job)
    assert min(resumed) == saved and max(resumed) == steps - 1
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], abs=1e-6), (step, loss, reference[step])
    # Every load and save says so on the terminal.
    assert f"checkpoint  loaded {ck / f'iter_{saved:07d}'} in " in result.stdout
    assert f"; resuming after step {saved}" in result.stdout
    assert f"checkpoint  saved {ck / f'iter_{steps:07d}'} in " in result.stdout

    # Resuming the finished run has nothing to train: it says so at once and starts nothing.
    again = run_launch("tracking=off", f"job_dir={tmp_path / 'again'}", "train.warmup_steps=1",
                       f"train.steps={steps}", f"checkpoint.load={ck}", f"checkpoint.save={ck}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"nothing to train: checkpoint.load={ck} is at step {steps} (iter_{steps:07d}) and " \
           f"train.steps={steps}" in again.stdout
    assert not (tmp_path / "again").exists() and "torch.distributed.run" not in again.stdout


def test_unfinished_save_is_ignored_and_a_broken_pointer_is_refused(run_launch, tmp_path):
    ck = tmp_path / "ck"
    train(run_launch, tmp_path, "first", "train.steps=2", f"checkpoint.save={ck}")
    (ck / "iter_0000003.partial").mkdir()
    (ck / "iter_0000003.partial" / "junk").write_text("half a save")
    second = run_launch("tracking=off", f"job_dir={tmp_path / 'second'}", "train.warmup_steps=1", "train.steps=5",
                        f"checkpoint.load={ck}")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert sorted(losses(tmp_path / "second")) == [2, 3, 4]
    # More steps than the saved run stretch the cosine decay (lr 1e-2 to 1e-3 after 1 warm-up
    # step): at step 2 of 2 it had reached the floor; of 5 it is a quarter into the decay.
    now = 0.001 + 0.009 * 0.5 * (math.cos(math.pi * (2 - 1) / (5 - 1)) + 1)
    assert (f"resume      train.steps 2 -> 5 changes the LR schedule: lr at step 2 was 1.0e-03, "
            f"is now {now:.1e}") in second.stdout.splitlines()

    (ck / "latest").write_text("iter_0000003\n")
    result = run_launch("tracking=off", f"checkpoint.load={ck}", f"job_dir={tmp_path / 'third'}", "train.warmup_steps=1")
    assert result.returncode == 2
    assert "not a complete checkpoint" in result.stderr
    assert not (tmp_path / "third").exists()


def test_saving_over_another_runs_checkpoints_is_refused(run_launch, tmp_path):
    ck = tmp_path / "ck"
    train(run_launch, tmp_path, "first", "train.steps=2", f"checkpoint.save={ck}")
    before = sorted(p.name for p in ck.iterdir())
    result = run_launch("tracking=off", f"checkpoint.save={ck}", "train.warmup_steps=1")
    assert result.returncode == 2 and "already holds checkpoints" in result.stderr
    assert sorted(p.name for p in ck.iterdir()) == before


LAYOUTS = {
    # TP=2 without SP is tp2_distopt's layout
    "tp2_sp": ("tiny_llama", ["+experiment=tiny_llama_tp2", "parallel.sp=true"]),
    # SP's all-gather/reduce-scatter fused with the matmuls (gridwright.megatron_internals.parallel_linear;
    # on CPU the same autograd functions with plain collectives)
    "tp2_sp_overlap": ("tiny_llama", ["+experiment=tiny_llama_tp2", "parallel.sp=true", "engine.tp_comm_overlap=true"]),
    # compiled layers (inductor on CPU) on each dimension that allows them (TP only with
    # the overlap functions: validation refuses compiling Megatron-Core's TP linears)
    "tp2_sp_overlap_compiled": ("tiny_llama", ["+experiment=tiny_llama_tp2", "parallel.sp=true",
                                               "engine.tp_comm_overlap=true", "engine.compile_layers=true"]),
    "dp2_compiled": ("tiny_llama", ["engine.compile_layers=true"]),
    "cp2_compiled": ("tiny_llama", ["parallel.cp=2", "engine.compile_layers=true"]),
    "pp2": ("tiny_llama", ["+experiment=tiny_llama_pp2"]),
    "pp2_vpp2": ("tiny_llama", ["+experiment=tiny_llama_pp2", "parallel.vpp=2"]),
    "dp2_distopt_overlap": ("tiny_llama", ["zero=stage1", "engine.overlap_grad_reduce=true",
                                           "engine.overlap_param_gather=true"]),
    "tp2_distopt": ("tiny_llama", ["+experiment=tiny_llama_tp2", "zero=stage2"]),
    "ep2": ("tiny_mixtral", ["+experiment=tiny_mixtral_cpu"]),
    "cp2": ("tiny_llama", ["parallel.cp=2"]),
    "cp2_a2a": ("tiny_llama", ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
    "moe_tp2_etp2": ("tiny_mixtral", ["model=tiny_mixtral", "parallel.moe_token_dispatcher=allgather", "parallel.tp=2",
                                      "parallel.sp=true"]),
    # expert-TP different from TP: expert gradients reduce over the expert DP group
    # (megatron_internals.fixes.reduce_expert_grads_over_expert_dp)
    "moe_tp2_etp1": ("tiny_mixtral", ["model=tiny_mixtral", "parallel.moe_token_dispatcher=allgather", "parallel.tp=2",
                                      "parallel.sp=true", "parallel.etp=1"]),
    "moe_etp2": ("tiny_mixtral", ["model=tiny_mixtral", "parallel.moe_token_dispatcher=allgather", "parallel.etp=2"]),
}


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """The uninterrupted 1-process run of a model (6 steps, a checkpoint every 2) with its
    `latest` pointed at step 2, made once per model and optimizer form and shared."""
    made = {}

    def get(model: str, distributed_optimizer: bool) -> tuple[Path, dict[int, float]]:
        key = (model, distributed_optimizer)
        if key not in made:
            root = tmp_path_factory.mktemp(f"one_{model}_{int(distributed_optimizer)}")
            ck = root / "ck"
            # the optimizer state's form follows the ZeRO stage
            args = ["cluster.gpus_per_node=1", f"model={model}", "parallel.moe_token_dispatcher=allgather",
                    *(["zero=stage1"] if distributed_optimizer else []), "tracking=off", "train.warmup_steps=1",
                    "train.steps=6", f"checkpoint.save={ck}", "checkpoint.save_interval=2", f"job_dir={root / 'one'}"]
            result = launch(args, cwd=root)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
            (ck / "latest").write_text("iter_0000002\n")  # resume from the middle of that run
            made[key] = ck, losses(root / "one")
        return made[key]

    return get


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_resharded_resume_matches_single_process(run_launch, tmp_path, name, single_process_run):
    """Resumed on 2 processes from a 1-process checkpoint, a run follows the uninterrupted
    1-process run step for step.

    Covers TP (with and without SP), PP (1F1B and interleaved), CP, DP with the distributed
    optimizer and communication overlap, EP, and MoE with TP=ETP=2 + SP and with an
    expert-TP different from TP: each must be the same mathematics, and
    the optimizer state must survive the resharding exactly.
    """
    model, layout = LAYOUTS[name]
    ck, one = single_process_run(model, "distopt" in name)
    two = train(run_launch, tmp_path, "two", *layout, "train.steps=6", f"checkpoint.load={ck}")
    assert sorted(two) == [2, 3, 4, 5]
    spec = json.loads((tmp_path / "two" / "summary.json").read_text())["layer_spec"]  # read from the model
    compiled = "+compiled" if "compiled" in name else ""
    if "overlap" in name and "tp" in name:  # the fused linears were built
        assert spec == f"local+sdpa{compiled}+tp_overlap"
    elif compiled:
        assert spec == "local+sdpa+compiled"
    elif "a2a" in name:
        assert spec == "local+sdpa+cp_a2a"
    for step in two:
        # fp32 on CPU; reductions are ordered differently across layouts.
        assert two[step] == pytest.approx(one[step], abs=1e-4), (step, one[step], two[step])
