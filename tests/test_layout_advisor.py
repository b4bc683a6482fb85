"""The layout advisor: the step-time model's arithmetic, its error on the GPU rows it was not
fitted on, and `launcher=advise` as a user runs it (ranked layouts, advise.json, MLflow)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import mlflow
import pytest
from conftest import REPO

from gridwright.planning.layout import ParallelLayout
from gridwright.planning.model_math import forward_flops_parts, param_counts
from gridwright.planning.step_time import CardSpeeds, load_calibration, predict_step, speeds_for

SPEEDS = CardSpeeds(card="H100", matmul_tflops={"bf16": 500.0}, attention_tflops=250.0,
                    other_s_per_unit={"bf16": 1e-10, "bf16_eager": 2e-10}, memory_tbps=3.0, host_s_per_kernel=5e-6,
                    kernels_per_layer=50.0, nvlink={c: {"alpha_s": 20e-6, "beta_s_per_byte": 1 / 300e9}
                                                    for c in ("all_reduce", "all_gather", "reduce_scatter",
                                                              "all_to_all", "send_recv")})
GPU8 = ["model=llama3_8b", "cluster=dgx_h100", "precision=bf16", "zero=stage1", "train.seq_length=4096",
        "train.micro_batch_size=1", "train.global_batch_size=64", "engine.compile_layers=true"]


def test_each_part_is_its_rate_times_its_work(compose):
    cfg = compose(*GPU8, "cluster.nodes=1", "parallel.tp=1", "parallel.pp=4", "parallel.vpp=2")
    layout = ParallelLayout.from_config(cfg)
    p = predict_step(cfg, layout, SPEEDS)
    m, micro = cfg.model, 64 // (1 * layout.dp)  # 32 micro-batches per step at DP=2
    tokens = micro * 4096
    parts = forward_flops_parts(m, 4096, param_counts(m))
    layers = m.num_layers / 4
    assert p.parts["matmul"] == pytest.approx(tokens * 3 * (layers * parts["layer_matmul"] + parts["output"]) / 500e12)
    assert p.parts["attention"] == pytest.approx(tokens * 3 * layers * parts["layer_attention"] / 250e12)
    assert p.parts["other"] == pytest.approx(tokens * m.hidden_size * layers * 1e-10)
    compute = p.parts["matmul"] + p.parts["attention"] + p.parts["other"]
    # interleaved 1F1B: (PP - 1) / VPP micro-batch times
    assert p.parts["bubble"] == pytest.approx(3 / 2 * compute / micro)
    assert p.step_s == pytest.approx(sum(p.parts.values())) and p.host_s < p.step_s and not p.host_bound
    assert p.tokens_per_s_per_gpu == pytest.approx(64 * 4096 / 8 / p.step_s)


def test_overlap_hides_dp_behind_the_last_backward_and_a_group_across_nodes_is_slower(compose):
    plain = compose(*GPU8, "cluster.nodes=1", "parallel.tp=1")
    lay = ParallelLayout.from_config(plain)
    bare = predict_step(plain, lay, SPEEDS)
    hidden = predict_step(compose(*GPU8, "cluster.nodes=1", "parallel.tp=1", "engine.overlap_grad_reduce=true"),
                          lay, SPEEDS)
    dp = bare.communication["dp"]["seconds"]
    assert bare.parts["exposed dp"] == pytest.approx(dp) and dp > 0
    compute = bare.parts["matmul"] + bare.parts["attention"] + bare.parts["other"]
    assert hidden.parts["exposed dp"] == pytest.approx(max(0.0, dp - compute / 8 * 2 / 3))
    # TP=16 over two DGX nodes leaves the NVLink domain: inter-node bandwidth (50 GB/s a GPU)
    inside = predict_step(*(lambda c: (c, ParallelLayout.from_config(c)))(
        compose(*GPU8, "cluster.nodes=2", "parallel.tp=8", "parallel.sp=true")), SPEEDS)
    across = predict_step(*(lambda c: (c, ParallelLayout.from_config(c)))(
        compose(*GPU8, "cluster.nodes=2", "parallel.tp=8", "parallel.sp=true", "parallel.order=tp-cp-ep-pp-dp",
                "parallel.pp=2")), SPEEDS)
    assert inside.communication["tp"]["seconds"] > 0 and "pp" in across.communication


def test_the_calibration_reproduces_its_own_row_and_names_its_files():
    from gridwright.evaluations.validate_advisor import CALIBRATION, compose_case

    h200 = speeds_for("NVIDIA H200", load_calibration())
    assert all(f in " ".join(h200.fitted_from) for f, _, _ in CALIBRATION.values())
    cfg = compose_case("llama3_8b_16l_1gpu_mb2")
    p = predict_step(cfg, ParallelLayout.from_config(cfg), h200)
    assert p.step_s == pytest.approx(1.529, rel=0.02)  # the row's measured step (1 x H200)
    te = compose_case("llama3_8b_16l_1gpu_mb2_te_fp8_delayed_graphs")  # Transformer Engine's FP8 rates
    assert predict_step(te, ParallelLayout.from_config(te), h200).step_s == pytest.approx(1.099, rel=0.02)
    with pytest.raises(LookupError, match="no calibrated speeds for the card 'B200'"):
        speeds_for("B200", load_calibration())


def test_held_out_gpu_rows_are_predicted_within_the_goal():
    from gridwright.evaluations.validate_advisor import (calibration_cases, pair_order, predicted_rows,
                                                         test_rows)

    rows, skipped = test_rows()
    names = {(r["call"], r["name"]) for r in rows}
    assert not names & calibration_cases() and len(rows) >= 15
    predicted = predicted_rows(rows, load_calibration())
    assert statistics.median(abs(r["error"]) for r in predicted) <= 0.15
    right, pairs = pair_order(predicted)
    assert pairs >= 30 and right / pairs >= 0.85
    assert any("deepspeed engine" in s["why"] for s in skipped)


def test_advise_ranks_valid_layouts_writes_them_and_logs_them(tmp_path):
    from gridwright.config.compose import compose_config
    from gridwright.validation.validate import validate

    db = tmp_path / "mlflow.db"
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "+experiment=llama3_70b", "cluster.nodes=128",
                        "launcher=advise", "launcher.top=3", f"job_root={tmp_path / 'jobs'}",
                        f"tracking.uri=sqlite:///{db}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    record = json.loads(next((tmp_path / "jobs").rglob("advise.json")).read_text())
    assert record["gpus"] == 1024 and record["counted"]["fit"] > 100 and record["seconds"] < 10
    speeds = [t["tokens_per_s_per_gpu"] for t in record["top"]]
    assert len(speeds) == 3 and speeds == sorted(speeds, reverse=True)
    assert all(t["memory_gib"] <= 79.6 and t["problem"] is None for t in record["top"])
    run_line = next(line for line in r.stdout.splitlines() if line.strip().startswith("run #1:"))
    words = run_line.split(": ", 1)[1].split()
    validate(compose_config(["+experiment=llama3_70b", "cluster.nodes=128", "launcher=plan", *words]))
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("gridwright").experiment_id])
    parents = [x for x in runs if x.data.tags.get("gridwright.kind") == "advice"]
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == 3
    assert sorted(c.data.metrics["predicted_tokens_per_s_per_gpu"] for c in children) == sorted(speeds)


@pytest.mark.parametrize("args, says", [
    (["launcher=advise"], "no calibrated speeds for the card 'cpu'"),
    (["cluster=dgx_h100", "launcher=advise", "launcher.top=0"], "launcher.top=0 must be at least 1. Fix: launcher.top=10."),
    (["cluster=dgx_h100", "launcher=advise", "launcher.top=2", "launcher.verify=3"],
     "launcher.verify=3 runs that many of the launcher.top=2 best layouts"),
    (["cluster=dgx_h100", "launcher=advise", "launcher.precisions=[bf16,fp9]"],
     "launcher.precisions names 'fp9', not a precision preset"),
])
def test_advise_refuses_what_it_cannot_rank_in_one_line(tmp_path, args, says):
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_root={tmp_path / 'jobs'}",
                        *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    # one problem, in the launcher's one form for a refused experiment
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_verify_runs_the_best_layouts_and_records_measured_beside_predicted(tmp_path):
    """`launcher.verify=2` on the laptop cluster, with this CPU described by a calibration file
    of its own (GRIDWRIGHT_STEP_TIME_CALIBRATION): the two best layouts train for real, and
    their measured speed lands in advise.json and on their MLflow runs."""
    import os

    shipped = json.loads((REPO / "toolkit" / "planning" / "step_time_calibration.json").read_text())
    cpu = dict(shipped["cards"][0], card="cpu", matmul_tflops={"bf16": 0.2}, attention_tflops=0.1, memory_tbps=0.02)
    calibration = tmp_path / "cpu_calibration.json"
    calibration.write_text(json.dumps({"format": shipped["format"], "cards": [cpu]}))
    db = tmp_path / "mlflow.db"
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "launcher=advise", "launcher.top=3",
                        "launcher.verify=2", "launcher.verify_steps=4", f"job_root={tmp_path / 'jobs'}",
                        f"tracking.uri=sqlite:///{db}"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "GRIDWRIGHT_STEP_TIME_CALIBRATION": str(calibration)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads(next((tmp_path / "jobs").rglob("advise.json")).read_text())
    verified = record["verified"]
    assert [v["rank"] for v in verified] == [1, 2] and all(v["status"] == "finished" for v in verified)
    assert all(v["measured_tokens_per_s_per_gpu"] > 0 and v["measured_step_s"] > 0 for v in verified)
    assert "measured order " in r.stdout
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("gridwright").experiment_id])
    advised = {x.data.tags["gridwright.advice_rank"]: x for x in runs if "gridwright.advice_rank" in x.data.tags}
    assert advised["1"].data.metrics["measured_tokens_per_s_per_gpu"] == pytest.approx(
        verified[0]["measured_tokens_per_s_per_gpu"])
    assert "measured_tokens_per_s_per_gpu" not in advised["3"].data.metrics


def test_a_planned_run_carries_its_prediction_as_params(compose, tmp_path):
    """A plan on a calibrated card records the prediction in plan.json, and its MLflow run's
    params carry it: a plan sweep's runs compare predicted speed in the runs table."""
    from gridwright.engine_rules.registry import rules
    from gridwright.planning.placement import plan_placement
    from gridwright.planning.plan import derive_plan
    from gridwright.tracking.mlflow_runs import plan_params

    cfg = compose(*GPU8, "cluster.nodes=1", "parallel.tp=2", "parallel.sp=true")
    layout = ParallelLayout.from_config(cfg)
    plan = derive_plan(cfg, layout, plan_placement(layout), rules(cfg.engine)).record()
    assert plan["predicted_step"]["card"] == "H100" and plan["predicted_step"]["step_s"] > 0
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    params = plan_params(tmp_path)
    assert float(params["predicted.tokens_per_s_per_gpu"]) == round(plan["predicted_step"]["tokens_per_s_per_gpu"])
    assert float(params["predicted.mfu"]) == pytest.approx(plan["predicted_step"]["mfu"], abs=1e-4)


def test_the_best_moe_layouts_pass_the_whole_validation(compose):
    """Expert groups stay inside the NVLink domain (validation refuses them across it), so
    the best Mixtral layouts on 64 GPUs are ones `validate` accepts."""
    from gridwright.validation.layout_advice import rank_layouts

    advice = rank_layouts(compose("model=mixtral_8x7b", "cluster=dgx_h100", "cluster.nodes=8",
                                  "train.seq_length=8192", "train.global_batch_size=128", "launcher=advise"), top=5)
    assert len(advice["candidates"]) == 5 and advice["problems"] == [None] * 5
    assert all(c.layout.etp * c.layout.ep <= 8 for c in advice["candidates"])


def test_one_gpu_advice_chooses_precision_compile_recompute_and_verifies_distinct_layouts(compose):
    """On one GPU the layout is fixed, so what the advisor chooses is the micro-batch,
    recompute, the offered precisions and compiled layers or eager; ZeRO is not a choice
    with one DP rank. `launcher.verify` takes layouts the model can order: none within 1 %
    of another it takes."""
    from gridwright.validation.layout_advice import TIE, advice_record, rank_layouts, to_verify

    cfg = compose("model=llama3_8b", "model.num_layers=16", "cluster=h100_x1", "cluster.gpu.name=NVIDIA_H200",
                  "cluster.gpu.memory_gib=139.8", "precision=bf16", "engine.layer_spec=torch_native",
                  "train.seq_length=4096", "train.global_batch_size=8", "launcher=advise",
                  "launcher.precisions=[bf16,fp8_tensorwise]")
    advice = rank_layouts(cfg, top=48)
    words = [c.overrides for c in advice["candidates"]]
    assert {w["zero"] for w in words} == {"stage0"}
    assert {w["precision"] for w in words} == {"bf16", "fp8_tensorwise"}
    assert {w["engine.compile_layers"] for w in words} == {True, False}
    assert {w["train.recompute"] for w in words} == {"none", "selective", "full"}
    best = words[0]
    assert (best["precision"], best["engine.compile_layers"], best["train.recompute"]) == ("fp8_tensorwise", True, "none")
    record = advice_record(cfg, advice)
    chosen = to_verify(record["top"], 3)
    speeds = [c["tokens_per_s_per_gpu"] for c in chosen]
    assert len(chosen) == 3 and chosen[0]["rank"] == 1 and speeds == sorted(speeds, reverse=True)
    assert all(a / b - 1 >= TIE for a, b in zip(speeds, speeds[1:]))
    # ties were passed over: the top list itself holds layouts predicted alike (micro-batch 1 and 2)
    assert record["top"][1]["tokens_per_s_per_gpu"] == pytest.approx(speeds[0], rel=TIE)
