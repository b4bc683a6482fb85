"""Evaluation sweeps in MLflow: `python launch.py -m ...` as one parent run with a nested run
per point, sweep.json, the comparison report, and `python -m gridwright.tracking.sync` afterwards.

Three sweeps, each run once per module and read back through a real SQLite MLflow store:
a plan-only layout sweep, a tracked training sweep, and an untracked one that is synced.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launch

INVALID_TP3 = "world size 2 (cluster.nodes x cluster.gpus_per_node) is not divisible by TP*PP*CP = 3*1*1 = 3"


def sweep(tmp: Path, *args) -> Path:
    """Run `launch.py -m ARGS` with its job root and store in `tmp`; return the sweep directory."""
    result = launch(["-m", *args, f"job_root={tmp / 'jobs'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"],
                    cwd=tmp, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (tmp / "stdout.txt").write_text(result.stdout)
    (sweep_dir,) = (tmp / "jobs" / "sweeps" / "tiny_llama").iterdir()
    return sweep_dir


def sync(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    return subprocess.run([sys.executable, "-m", "gridwright.tracking.sync", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def runs_of(db: Path) -> dict:
    """Runs of the `gridwright` experiment by name (parent: the one without a parent)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("gridwright")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    return client, {r.info.run_name: r for r in runs}


def artifacts(client, run) -> set:
    return {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.fixture(scope="module")
def plan_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    return tmp, sweep(tmp, "parallel.tp=1,2,3", "launcher=plan")


@pytest.fixture(scope="module")
def training_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    return tmp, sweep(tmp, "parallel.tp=1,2", "train.steps=3")


@pytest.fixture(scope="module")
def offline_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    return tmp, sweep(tmp, "parallel.tp=2,3", "train.steps=3", "tracking=off")


def test_slug_names_the_degrees_above_one():
    from gridwright.planning.layout import ParallelLayout

    def slug(world=2, **kw):
        kw.setdefault("etp", kw.get("tp", 1))  # as from_config: expert TP defaults to TP
        return ParallelLayout(world_size=world, gpus_per_node=8, nvlink_domain_size=8, **kw).slug()

    assert slug() == "dp2"
    assert slug(tp=2, sp=True) == "tp2-sp-dp1"
    assert slug(pp=2, vpp=2) == "pp2-vpp2-dp1"
    assert slug(ep=2, etp=1) == "ep2-dp2"
    assert slug(world=8, tp=2, sp=True) == "tp2-sp-dp4"
    assert slug(world=16, tp=2, cp=2, pp=2, ep=2, etp=1) == "tp2-cp2-pp2-ep2-etp1-dp2"


def test_job_params_without_a_plan(compose, tmp_path):
    from gridwright.planning.layout import ParallelLayout
    from gridwright.tracking.mlflow_runs import job_params

    cfg = compose("parallel.tp=2")
    params = job_params(cfg, ParallelLayout.from_config(cfg), tmp_path)  # no plan.json here
    assert params["derived.dp"] == "1" and params["derived.accumulation"] == "4"
    assert params["derived.world_size"] == "2" and params["derived.expert_dp"] == "1"
    assert params["parallel.tp"] == "2" and not any(k.startswith(("flops.", "memory.")) for k in params)
    (tmp_path / "plan.json").write_text(json.dumps({
        "flops_per_token": {"megatron": 1.5e9, "palm": 1.7e9}, "flops_definition": "megatron",
        "peak_tflops": 989.0, "peak_kind": "bf16", "params": {"total": 8}, "memory_estimate_gib": None}))
    params = job_params(cfg, ParallelLayout.from_config(cfg), tmp_path)
    assert params["flops.per_token_palm"] == "1700000000.0" and params["flops.peak_kind"] == "bf16"
    assert "memory.estimate_gib" not in params  # null: not estimated


def test_report_compares_gpu_points(tmp_path):
    """The table and plots from what GPU runs leave: MFU under both definitions (the other
    one from plan.json's FLOPs ratio when a run reports only its own), the step breakdown."""
    from gridwright.tracking.sweep import SweepRecord
    from gridwright.tracking.sweep_report import write_report

    plan = {"flops_per_token": {"megatron": 1.0e9, "palm": 1.2e9}, "memory_estimate_gib": 50.0}
    comm = {"compute_s": 0.8, "exposed_comm_s": 0.15, "idle_s": 0.05, "step_s": 1.0,
            "by_group": {"dp": {"comm_s": 0.2, "exposed_s": 0.05}, "tp": {"comm_s": 0.1, "exposed_s": 0.1}}}
    summaries = {"0-tp2-dp4": {"mfu": 0.40, "mfu_palm": 0.48, "tokens_per_s_per_gpu": 9000.0, "mean_step_time_s": 1.0,
                               "memory_peak_gib": 45.5, "memory_estimate_gib": 50.0, "communication": comm},
                 "1-dp8": {"mfu": 0.54, "flops_definition": "palm", "tokens_per_s_per_gpu": 10000.0}}
    points = []
    for num, (name, summary) in enumerate(summaries.items()):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        (tmp_path / name / "plan.json").write_text(json.dumps(plan))
        points.append({"num": num, "name": f"llama3_8b {name[2:]}", "slug": name[2:], "status": "finished",
                       "job_dir": name, "layout": "", "overrides": [], "error": ""})
    points.append({"num": 2, "name": "llama3_8b tp3-dp0", "slug": "tp3-dp0", "status": "invalid", "job_dir": None,
                   "layout": "", "overrides": [], "error": "TP=3 does not divide 8"})
    record = SweepRecord(id="x", name="llama3_8b sweep parallel.tp=1,2,3", experiment="llama3_8b",
                         overrides=["parallel.tp=1,2,3"], tracking={}, started_ms=0, points=points)
    (tmp_path / "1-dp8" / "comm_profile.png").write_bytes(b"png")  # a point's alpha-beta fit plot
    report = write_report(tmp_path, record)
    assert {p.name for p in report.files} == {"comparison.md", "comparison.csv", "mfu.png", "step_breakdown.png",
                                              "throughput.png", "comm_profile.png"}
    assert report.best["name"] == "llama3_8b dp8" and report.best["mfu"] == pytest.approx(0.45)  # 0.54 palm
    table = (tmp_path / "comparison.md").read_text()
    assert "| 0 | llama3_8b tp2-dp4 |  | finished |  | 9,000 | 40.0 % | 48.0 % | 1000.0 | 45.50 / 50.00 | " \
           "800.0 | 50.0 | 100.0 | 50.0 |" in table
    assert "| 1 | llama3_8b dp8 |  | finished |  | 10,000 | 45.0 % | 54.0 % |" in table
    assert "- #2 llama3_8b tp3-dp0: TP=3 does not divide 8" in table
    assert report.counts_text() == "2 finished, 1 invalid"


@pytest.mark.slow
def test_plan_sweep_is_one_parent_with_a_nested_run_per_point(plan_sweep):
    tmp, sweep_dir = plan_sweep
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert record["overrides"][:2] == ["parallel.tp=1,2,3", "launcher=plan"] and record["status"] == "finished"
    points = record["points"]
    assert [(p["num"], p["status"], p["job_dir"]) for p in points] == [
        (0, "planned", "0-dp2"), (1, "planned", "1-tp2-dp1"), (2, "invalid", None)]
    assert points[2]["error"].startswith(INVALID_TP3) and "\n" not in points[2]["error"]
    assert (sweep_dir / "1-tp2-dp1" / "placement.json").is_file() and not (tmp / "jobs" / "tiny_llama").exists()

    client, runs = runs_of(tmp / "mlflow.db")
    parent = runs["tiny_llama sweep parallel.tp=1,2,3"]
    assert set(runs) == {parent.info.run_name, "tiny_llama dp2", "tiny_llama tp2-dp1", "tiny_llama tp3-dp0"}
    assert parent.info.status == "FINISHED" and "mlflow.parentRunId" not in parent.data.tags
    assert {"comparison.md", "comparison.csv", "sweep.json"} <= artifacts(client, parent)
    for name, status, tag in (("dp2", "FINISHED", "planned"), ("tp2-dp1", "FINISHED", "planned"),
                              ("tp3-dp0", "FAILED", "invalid")):
        run = runs[f"tiny_llama {name}"]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert (run.info.status, run.data.tags["gridwright.status"]) == (status, tag), name
    planned = runs["tiny_llama tp2-dp1"].data.params
    assert planned["derived.dp"] == "1" and planned["derived.accumulation"] == "4" and planned["parallel.tp"] == "2"
    invalid = runs["tiny_llama tp3-dp0"]
    assert invalid.data.tags["gridwright.error"].startswith(INVALID_TP3) and invalid.data.params["parallel.tp"] == "3"
    out = (tmp / "stdout.txt").read_text()
    assert f"see it: mlflow ui --backend-store-uri sqlite:///{tmp / 'mlflow.db'} (port 5000, its default, " \
           "which the links below assume)" in out
    assert "compare: http://127.0.0.1:5000/" in out and "chart: " not in out  # nothing trained: no chart made


def test_single_plan_does_not_touch_mlflow(tmp_path):
    result = launch(["launcher=plan", f"job_root={tmp_path / 'jobs'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "jobs" / "sweeps").exists()


@pytest.mark.slow
def test_training_sweep_nests_finished_runs_and_compares_them(training_sweep):
    tmp, sweep_dir = training_sweep
    client, runs = runs_of(tmp / "mlflow.db")
    parent = runs["tiny_llama sweep parallel.tp=1,2"]
    assert len(runs) == 3 and parent.info.status == "FINISHED"
    for name in ("dp2", "tp2-dp1"):
        run = runs[f"tiny_llama {name}"]
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert len(client.get_metric_history(run.info.run_id, "loss")) == 3
        assert run.data.metrics["final_loss"] == pytest.approx(
            client.get_metric_history(run.info.run_id, "loss")[-1].value, abs=5e-5)
        assert {"config.yaml", "plan.json", "summary.json", "metrics.jsonl"} <= artifacts(client, run)
    assert {"comparison.md", "comparison.csv", "throughput.png", "points.png"} <= artifacts(client, parent)
    assert f"/runs/{parent.info.run_id}/artifacts/points.png" in (training_sweep[0] / "stdout.txt").read_text()
    best = parent.data.tags["gridwright.best_point"]
    assert best in ("#0 tiny_llama dp2", "#1 tiny_llama tp2-dp1")
    best_run = runs[best.split(" ", 1)[1]]  # the parent's row shows the best point's numbers
    assert parent.data.metrics["tok_s_gpu"] == pytest.approx(best_run.data.metrics["tok_s_gpu"])
    assert parent.data.metrics["final_loss"] == pytest.approx(best_run.data.metrics["final_loss"])
    exp = client.get_experiment(parent.info.experiment_id)
    view = json.loads(exp.tags[f"mlflow.sharedViewState.gridwright-sweep-{parent.info.run_id}"])
    assert view["searchFilter"] == f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    assert view["groupsExpanded"] == {f"tag.mlflow.parentRunId.{parent.info.run_id}": True}
    table = (sweep_dir / "comparison.md").read_text()
    assert "| 1 | tiny_llama tp2-dp1 | `parallel.tp=2` | finished | TP=2 PP=1 CP=1 DP=1 |" in table
    rows = (sweep_dir / "comparison.csv").read_text().splitlines()
    assert rows[0].startswith("num,name,point,status,layout,tokens_per_s_per_gpu,mfu,mfu_palm,step_time_ms")
    assert len(rows) == 3


@pytest.mark.slow
def test_untracked_sweep_is_synced_once(offline_sweep, training_sweep, capsys):
    tmp, sweep_dir = offline_sweep
    assert not (tmp / "mlflow.db").exists()  # tracking=off: nothing touched MLflow
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    assert [p["status"] for p in points] == ["finished", "invalid"]
    first = sync(sweep_dir, cwd=tmp)
    assert first.returncode == 0 and "with 3 new run(s)" in first.stdout, first
    client, runs = runs_of(tmp / "mlflow.db")
    second = sync(sweep_dir, cwd=tmp)
    assert second.returncode == 0 and second.stdout.startswith("already logged: "), second
    _, again = runs_of(tmp / "mlflow.db")
    assert {n: r.info.run_id for n, r in again.items()} == {n: r.info.run_id for n, r in runs.items()}

    # A point whose run is gone (deleted here) is filled in; nothing else is logged again.
    from gridwright.tracking.sync import main as sync_main

    client.delete_run(runs["tiny_llama tp3-dp0"].info.run_id)
    assert sync_main([str(sweep_dir), "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"]) == 0
    assert "with 1 new run(s)" in capsys.readouterr().out
    client, runs = runs_of(tmp / "mlflow.db")
    assert len(runs) == 3
    parent = runs["tiny_llama sweep parallel.tp=2,3"]
    assert len(client.get_metric_history(parent.info.run_id, "tok_s_gpu")) == 1

    synced = runs["tiny_llama tp2-dp1"]
    assert (synced.info.status, runs["tiny_llama tp3-dp0"].info.status) == ("FINISHED", "FAILED")
    assert synced.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert synced.info.start_time < synced.info.end_time
    assert {"comparison.md", "comparison.csv", "throughput.png", "sweep.json"} <= artifacts(client, parent)
    history = [json.loads(l) for l in (sweep_dir / points[0]["job_dir"] / "metrics.jsonl").read_text().splitlines()]
    loss = sorted(client.get_metric_history(synced.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.value for m in loss] == pytest.approx([h["loss"] for h in history])

    # The same point logged live (tracked sweep) and afterwards (sync) holds the same record.
    live_client, live_runs = runs_of(training_sweep[0] / "mlflow.db")
    live = live_runs["tiny_llama tp2-dp1"]
    ignore = {"job_root", "tracking.enabled", "tracking.uri"}
    assert {k for k in live.data.params if k not in ignore} == {k for k in synced.data.params if k not in ignore}
    assert set(live.data.metrics) == set(synced.data.metrics)
    live_loss = sorted(live_client.get_metric_history(live.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.value for m in live_loss] == pytest.approx([m.value for m in loss], abs=1e-5)


@pytest.mark.slow
def test_job_dir_is_synced_once_and_bad_input_is_refused(offline_sweep, tmp_path, capsys):
    tmp, sweep_dir = offline_sweep
    job = sweep_dir / "0-tp2-dp1"
    uri = f"sqlite:///{tmp_path / 'single.db'}"
    assert sync(job, "--tracking-uri", uri, cwd=tmp_path).returncode == 0
    second = sync(job, "--tracking-uri", uri, cwd=tmp_path)
    assert second.returncode == 0 and second.stdout.startswith("already logged: ")
    client, runs = runs_of(tmp_path / "single.db")
    (run,) = runs.values()
    assert run.info.run_name == "tiny_llama tp2-dp1" and run.info.status == "FINISHED"
    assert run.data.tags["gridwright.job_id"] == json.loads((job / "job.json").read_text())["job_id"]

    # A torchrun job logged before it ran is planned; once it has run, the same run gets its results.
    from gridwright.tracking.sync import main as sync_main

    emitted = tmp_path / "emitted"
    assert launch(["launcher=torchrun", "tracking=off", f"job_dir={emitted}"], cwd=tmp_path).returncode == 0
    assert sync_main([str(emitted), "--tracking-uri", uri]) == 0
    for name in ("metrics.jsonl", "summary.json"):
        (emitted / name).write_text((job / name).read_text())
    assert sync_main([str(emitted), "--tracking-uri", uri]) == 0
    assert sync_main([str(emitted), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[-3:]] == [f"logged {emitted}", f"logged {emitted}", "already logged"]
    _, runs = runs_of(tmp_path / "single.db")
    assert len(runs) == 2 and len({line.split()[-3] for line in out[-3:-1]}) == 1  # one run, logged twice
    (upgraded,) = [r for r in runs.values() if r.data.tags["gridwright.job_dir"] == str(emitted)]
    assert (upgraded.info.status, upgraded.data.tags["gridwright.status"]) == ("FINISHED", "finished")
    assert upgraded.data.metrics["final_loss"] > 0

    for bad in (tmp_path / "missing", sweep_dir.parent):
        result = sync(bad, "--tracking-uri", f"sqlite:///{tmp_path / 'bad.db'}", cwd=tmp_path)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "bad.db").exists()


@pytest.mark.slow
def test_committed_gpu_sweep_syncs_with_distinct_names_and_its_measurements(tmp_path):
    """The evaluation sweep measured on 2 x H100 (records committed without traces) logs as
    one parent and seven nested runs; points that differ only by preset get distinct names."""
    import shutil  # a copy: syncing writes the comparison table and plots into the sweep directory

    name = "eval_sweep_2xh100_20261126-1201"
    sweep_dir = Path(shutil.copytree(Path(__file__).parent / "data" / "sweeps" / name, tmp_path / name))
    result = sync(sweep_dir, "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", cwd=tmp_path)
    assert result.returncode == 0 and "with 8 new run(s)" in result.stdout, result
    assert re.search(r"compare: http://127\.0\.0\.1:5000/#/experiments/\d+/runs\?workflowType=machine_learning"
                     r"&viewStateShareKey=gridwright-sweep-\w+$", result.stdout, flags=re.M), result.stdout
    client, runs = runs_of(tmp_path / "mlflow.db")
    assert len(runs) == 8  # names are unique: the dict kept every run
    assert {"eval_bench dp2 eval_dp2", "eval_bench dp2 eval_dp2_overlap", "eval_bench tp2-sp-dp1 eval_tp2_sp"} <= set(runs)
    parent = next(r for r in runs.values() if "mlflow.parentRunId" not in r.data.tags)
    assert {"comparison.md", "mfu.png", "step_breakdown.png", "comm_profile.png"} <= artifacts(client, parent)
    tp_run = runs["eval_bench tp2-sp-dp1 eval_tp2_sp"]
    tp = tp_run.data.metrics
    summary = json.loads((sweep_dir / "3-tp2-sp-dp1" / "summary.json").read_text())
    assert tp["mfu_megatron_pct"] == pytest.approx(100 * summary["mfu"], abs=0.005)  # rounded for the table
    assert tp["mfu_megatron_pct"] < tp["mfu_palm_pct"]
    assert tp["exposed_tp_ms"] == pytest.approx(1000 * summary["communication"]["by_group"]["tp"]["exposed_s"], abs=0.005)
    assert tp["step_ms"] == pytest.approx(1000 * summary["mean_step_time_s"], abs=0.005)
    # Durations come from the job's records (the sweep's times), not the files' times of this copy.
    points = {p["job_dir"]: p for p in json.loads((sweep_dir / "sweep.json").read_text())["points"]}
    for run in runs.values():
        if "mlflow.parentRunId" in run.data.tags:
            point = points[Path(run.data.tags["gridwright.job_dir"]).name]
            job = json.loads((sweep_dir / point["job_dir"] / "job.json").read_text())
            assert (run.info.start_time, run.info.end_time) == (job["created_ms"], point["ended_ms"])
            assert 0 < run.info.end_time - run.info.start_time < 120_000


@pytest.mark.parametrize("sweep", ["eval_sweep_2xh100_20261126-1201", "engines_sweep_2xh200_20261127-2346"])
def test_committed_gpu_sweeps_give_their_results_tables(sweep):
    """The results file of each committed GPU sweep: every point's engine, host wait and
    communication per kind (pipeline send/recv, which records no sizes, says n/a)."""
    from gridwright.evaluations.eval_results import tables

    text = tables(Path(__file__).resolve().parent / "data" / "sweeps" / sweep)
    points = [line for line in text.splitlines() if line.startswith("| ") and "dp" in line.split("|")[1]]
    assert points and "## Communication per kind" in text
    if sweep.startswith("engines"):
        assert "GPU: 2 x NVIDIA_H200" in text
        assert {"megatron ZeRO-1", "megatron ZeRO-3", "deepspeed ZeRO-1", "deepspeed ZeRO-2", "deepspeed ZeRO-3",
                "deepspeed ZeRO-2+offload"} <= {cell.strip() for line in text.splitlines() for cell in line.split("|")}
        zero3 = next(line for line in text.splitlines() if "deepspeed ZeRO-3 |" in line)
        assert zero3.split("|")[13].strip() == "233.9"  # host wait ms, from the sweep's traces
    else:
        assert "| send_recv |" in text and "n/a" in text
