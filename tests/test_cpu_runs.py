"""Real training runs: Megatron-Core over gloo in 2 CPU processes, launched as a user would.

Each test runs `python launch.py ...` end to end (torchrun, 2 workers) and reads back
what the run wrote: metrics.jsonl, the per-rank coordinates and the MLflow records.
"""
import json

import pytest
from conftest import only_job_dir

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 8


def run_experiment(run_launch, tmp_path, *overrides):
    result = run_launch(*overrides, f"train.steps={STEPS}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    job = only_job_dir(tmp_path)
    history = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return result, job, history


def assert_trains(history):
    assert [h["step"] for h in history] == list(range(STEPS))
    losses = [h["loss"] for h in history]
    assert losses[0] == pytest.approx(5.55, abs=0.05)  # ln(256): an untrained model
    assert losses[-1] < losses[0] - 0.15, losses


def test_default_run_logs_to_mlflow(run_launch, tmp_path):
    from mlflow.tracking import MlflowClient

    result, job, history = run_experiment(run_launch, tmp_path)
    assert_trains(history)
    assert "TP=1 PP=1 CP=1 DP=2" in result.stdout
    summary = json.loads((job / "summary.json").read_text())
    assert summary["placement_verified"] is True and summary["layer_spec"] == "local+sdpa"
    ranks = sorted((job / "ranks").glob("rank_*.json"))
    assert [json.loads(p.read_text())["dp"] for p in ranks] == [0, 1]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("gridwright")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["parallel.tp"] == "1" and run.data.params["model.name"] == "tiny_llama"
    assert run.data.params["train.steps"] == str(STEPS)
    assert run.data.tags["gridwright.engine"] == "megatron"
    assert run.data.tags["gridwright.layout"] == "TP=1 PP=1 CP=1 DP=2"
    assert len(run.data.tags["mlflow.source.git.commit"]) >= 7
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [m.value for m in sorted(loss, key=lambda m: m.step)] == pytest.approx([h["loss"] for h in history])
    for key in ("lr", "grad_norm", "step_time_ms", "step_tok_s_gpu"):
        assert len(client.get_metric_history(run.info.run_id, key)) == STEPS, key
    step_ms = sorted(client.get_metric_history(run.info.run_id, "step_time_ms"), key=lambda m: m.step)
    assert [m.value for m in step_ms] == pytest.approx([1000 * h["step_time_s"] for h in history])
    # The runs table's numbers: the headline set in ms, GiB and %, nothing else (the long
    # tail stays in summary.json and metrics.jsonl).
    metrics = run.data.metrics
    assert set(metrics) == {"loss", "lr", "grad_norm", "step_time_ms", "step_tok_s_gpu", "tok_s_gpu", "step_ms",
                            "peak_mem_gib", "final_loss"}  # a CPU has no known peak: no made-up MFU
    assert metrics["tok_s_gpu"] == pytest.approx(summary["tokens_per_s_per_gpu"], abs=0.05)  # rounded for the table
    assert metrics["step_ms"] == pytest.approx(1000 * summary["mean_step_time_s"], abs=0.005)
    assert metrics["final_loss"] == pytest.approx(history[-1]["loss"], abs=5e-5)
    assert metrics["peak_mem_gib"] == pytest.approx(summary["memory_peak_gib"], abs=5e-4)
    view = json.loads(exp.tags["mlflow.sharedViewState.gridwright-runs"])
    assert "metrics.`tok_s_gpu`" in view["selectedColumns"] and "tags.`gridwright.layout`" in view["selectedColumns"]
    assert run.data.params["flops.definition"] == "megatron" and run.data.params["flops.peak_kind"] == "bf16"
    assert float(run.data.params["flops.per_token_megatron"]) == summary["flops_per_token"]["megatron"]
    assert run.info.run_name == "tiny_llama dp2" and run.data.params["derived.dp"] == "2"
    assert job.parent.name == "tiny_llama"  # no preset: named after the model
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # The end of the run on the terminal: what it learned, how fast, MFU or why none, memory, where to look.
    out = result.stdout
    assert (f"compare: http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
            "&viewStateShareKey=gridwright-runs") in out
    assert f"summary     {STEPS} steps: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}" in out
    assert f"{summary['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU" in out and "(mean of steps 1-7)" in out
    assert "MFU none: the device (cpu, cluster laptop) has no known peak FLOP/s" in out
    assert f"peak memory {summary['memory_peak_gib']:.2f} GiB resident (RSS), rank {summary['memory_peak_rank']}" in out
    assert f"mlflow      run {run.info.run_id} (FINISHED) in sqlite:///{tmp_path / 'mlflow.db'}" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in out
    assert f"#/experiments/{exp.experiment_id}/runs/{run.info.run_id}" in out
    # Known warnings of the stack (no Apex/TE, Megatron-Core's deprecations) are filtered.
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "placement.json", "placement.csv", "metrics.jsonl", "summary.json"} <= artifacts


def test_pipeline_parallel_with_a_profiling_window(run_launch, tmp_path):
    """PP=2 with steps 2-3 traced: a compressed trace per rank, the timer beside it, and an
    analysis that says why a CPU run has no communication figures (never a NaN)."""
    import gzip

    result, job, history = run_experiment(run_launch, tmp_path, "+experiment=tiny_llama_pp2", "tracking=off",
                                          "evaluate.profile_steps=[2,4]")
    assert_trains(history)
    coords = [json.loads(p.read_text()) for p in sorted((job / "ranks").glob("rank_*.json"))]
    assert [c["pp"] for c in coords] == [0, 1] and coords[0]["groups"]["pp"] == [0, 1]
    for rank in (0, 1):
        with gzip.open(job / "traces" / f"rank_{rank:05d}.json.gz", "rt") as f:
            trace = json.load(f)
        assert trace["distributedInfo"]["rank"] == rank
        marks = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("gridwright_step_"))
        assert marks == ["gridwright_step_2", "gridwright_step_3"]
        timer = json.loads((job / "traces" / f"rank_{rank:05d}.steps.json").read_text())
        assert sorted(timer) == ["2", "3"] and all(v > 0 for v in timer.values())
    comm = json.loads((job / "communication.json").read_text())
    assert comm["available"] is False and "CPU/gloo" in comm["reason"]
    summary_text = (job / "summary.json").read_text()
    summary = json.loads(summary_text)
    json.loads(summary_text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["communication"]["available"] is False
    assert summary["steps_averaged"] == [1, 4, 5, 6, 7]  # warm-up and traced steps left out
    assert sorted(summary["memory_peak_gib_per_rank"]) == ["0", "1"]
    assert "communication: not measured" in result.stdout


def test_mixtral_expert_parallel(run_launch, tmp_path):
    result, job, history = run_experiment(run_launch, tmp_path, "+experiment=tiny_mixtral_cpu", "tracking=off")
    assert_trains(history)
    coords = [json.loads(p.read_text()) for p in sorted((job / "ranks").glob("rank_*.json"))]
    assert [c["ep"] for c in coords] == [0, 1] and coords[1]["groups"]["ep"] == [0, 1]
    assert "EP=2" in result.stdout


def test_recompute_keeps_the_mathematics_and_clipping_changes_it(run_launch, tmp_path):
    """Full and selective recompute give the plain run's losses. Clipping the gradient norm
    to 1e-3 must change the run: Adam undoes most of a uniform scaling, but not its
    epsilon, so an applied clip shows (deterministic CPU runs are otherwise identical)."""

    def losses(name, *overrides):
        result = run_launch("tracking=off", "train.steps=5", f"job_dir={tmp_path / name}", *overrides)
        assert result.returncode == 0, result.stderr[-4000:]
        return [json.loads(l)["loss"] for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    plain = losses("plain")
    assert losses("full", "train.recompute=full") == pytest.approx(plain, abs=1e-5)
    assert losses("selective", "train.recompute=selective") == pytest.approx(plain, abs=1e-5)
    clipped = losses("clipped", "train.grad_clip=0.001")
    assert clipped[:2] == pytest.approx(plain[:2], abs=1e-6)  # step 0 updates with lr 0
    assert abs(clipped[-1] - plain[-1]) > 1e-3


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sixteen_bit_training(run_launch, tmp_path, precision):
    """bf16, and fp16 with Megatron-Core's dynamic loss scaling, train on CPU too."""
    result = run_launch("tracking=off", f"precision={precision}", "zero=stage1", "train.steps=10",
                        f"job_dir={tmp_path / precision}")
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(l) for l in (tmp_path / precision / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert sum(r["update_skipped"] for r in rows) <= 3  # fp16 may skip a few while the scale settles
