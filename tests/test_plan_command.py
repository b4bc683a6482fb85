"""`launch.py ... launcher=plan` and the refusals before start: fast, named, honest.

A plan composes, validates and places without importing torch, Megatron-Core, DeepSpeed
or MLflow (their imports take seconds); a run without a preset is named after what it
trains; a GPU run on a machine without the GPUs is refused before anything is created.
"""
import json
import os
import subprocess
import sys
import pytest

HEAVY = ("torch", "megatron", "deepspeed", "transformers", "mlflow")

# Runs launch.py's entry point in this interpreter, then lists the heavy packages imported.
IMPORT_PROBE = """
import json, sys
args, heavy_names = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
sys.argv = ["launch.py"] + args
from gridwright.cli import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & heavy_names)
print("HEAVY=" + json.dumps(heavy))
"""


@pytest.mark.slow
def test_plans_import_neither_torch_nor_megatron(tmp_path):
    for args, expected in ((["+experiment=mixtral_ep8", "launcher=plan"], []),
                           (["+experiment=llama3_70b"], []),  # a Slurm script
                           (["+experiment=llama3_8b", "launcher=torchrun", "launcher.master_addr=node0"], []),
                           # A planned sweep is recorded in MLflow (planned runs), still without torch.
                           (["-m", "parallel.tp=1,2", "+experiment=llama3_8b", "launcher=plan"], ["mlflow"]),
                           # the advisor ranks 1,024 GPUs' layouts torch-free (its runs go to MLflow)
                           (["+experiment=llama3_70b", "cluster.nodes=128", "launcher=advise"], ["mlflow"])):
        argv = [*args, f"job_root={tmp_path / 'jobs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
        r = subprocess.run([sys.executable, "-c", IMPORT_PROBE, json.dumps(argv), json.dumps(HEAVY)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"HEAVY={json.dumps(expected)}" in r.stdout, (args, r.stdout[-500:])
    # The probe does see an import when there is one: the engine's module imports torch.
    r = subprocess.run([sys.executable, "-c", "import sys, gridwright.engines.megatron_checkpoint; "
                        "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "True"


def test_a_run_without_preset_is_named_after_what_it_trains(run_launch, tmp_path):
    r = run_launch("model=llama3_8b", "cluster=dgx_h100", "launcher=plan", "train.global_batch_size=16",
                   "train.recompute=full", "zero=stage1")
    assert r.returncode == 0, r.stderr[-2000:]
    (job,) = (tmp_path / "jobs" / "llama3_8b-dgx_h100-stage1").iterdir()
    assert json.loads((job / "plan.json").read_text())["experiment"] == "llama3_8b-dgx_h100-stage1"
    assert "experiment  llama3_8b-dgx_h100-stage1" in r.stdout
    # The root's tiny-CPU training settings and fp32 came along unasked: said, not refused.
    assert "note        these train.* values are the root defaults, sized for tiny_llama on a CPU: " \
           "steps=20, seq_length=64" in r.stdout
    assert "+experiment=llama3_8b" in r.stdout
    assert "note        precision=fp32 on GPUs (the CPU default)" in r.stdout


def test_a_preset_names_itself_and_gets_no_notes(run_launch, tmp_path):
    r = run_launch("+experiment=llama3_8b", "launcher=plan")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "jobs" / "llama3_8b").is_dir()
    # no root-default notes; the one note names the TP+SP recipe measured faster (speed_notes)
    notes = [line for line in r.stdout.splitlines() if line.startswith("note ")]
    assert len(notes) == 1 and "measured faster for this layout: engine.compile_layers=true" in notes[0], notes
    # Files written atomically keep the umask's permissions (not mkstemp's private 0600).
    (plan,) = (tmp_path / "jobs" / "llama3_8b").glob("*/plan.json")
    umask = os.umask(0)
    os.umask(umask)
    assert plan.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.slow
def test_gpu_cluster_without_cuda_is_refused_before_start(run_launch, tmp_path):
    r = run_launch("+bench=bench_gpu")
    assert r.returncode == 2
    assert "cluster 'h100_x1' runs 1 process(es) on CUDA GPUs, but this machine has 0 CUDA device(s)" in r.stderr
    assert "nothing was started" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "mlflow.db").exists()
    # The same experiment plans (or is emitted for a cluster) on this machine.
    assert run_launch("+bench=bench_gpu", "launcher=plan").returncode == 0


def test_derived_names(compose):
    assert compose().name == "tiny_llama"
    assert compose("engine=deepspeed", "zero=stage3").name == "tiny_llama-deepspeed-stage3"
    assert compose("model=llama3_8b", "cluster=dgx_h100", "launcher=plan").name == "llama3_8b-dgx_h100"
    assert compose("+bench=bench_gpu").name == "bench_gpu"
    assert compose("model=tiny_mixtral", "name=mine").name == "mine"
    # The name exists before values are resolved: `${name}` in a value sees it.
    assert compose("model=tiny_mixtral", "checkpoint.save=ckpt/${name}").checkpoint.save == "ckpt/tiny_mixtral"


def test_one_plan_counts_parameters_and_estimates_memory_once(compose, tmp_path, capsys):
    """Validation, plan.json and the printed plan read one plan: a plan with a memory check
    and a communication prediction counts the parameters once and estimates memory once
    (counted by the profiler around the real command, not by a stand-in)."""
    import cProfile
    import pstats
    from pathlib import Path

    from gridwright import cli

    profile = Path(__file__).parent / "data" / "comm_profile_2xh100.json"
    cfg = compose("+bench=bench_gpu", "cluster=h100_x2", "launcher=plan", f"job_root={tmp_path}",
                  f"cluster.comm_profile={profile}")
    profiler = cProfile.Profile()
    assert profiler.runcall(cli.run, cfg).status == "planned"
    calls = {f"{Path(file).name}:{name}": stats[1] for (file, _, name), stats in pstats.Stats(profiler).stats.items()}
    assert calls["model_math.py:param_counts"] == 1
    assert calls["memory_estimate.py:estimate_memory"] == 1
    # once on the cluster's measured profile, once on the step-time model's links (NVLink, inter-node)
    assert calls["comm_model.py:predict_step_communication"] == 2
    printed = capsys.readouterr().out
    plan = json.loads(next(tmp_path.rglob("plan.json")).read_text())
    # what was printed is what plan.json holds
    assert f"{plan['memory_estimate_gib']:.1f} GiB = weights" in printed
    assert f"accumulation {plan['accumulation']} x DP 2" in printed
    assert plan["predicted_communication"]["dp"]["bytes"] > 0 and "comm/step   dp" in printed
    assert f"predicted   step {plan['predicted_step']['step_s']:.3f} s" in printed
