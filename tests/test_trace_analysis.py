"""The trace analysis on a hand-made trace (figures known by construction) and on real
traces captured on 2 x H100 (tests/data/gpu_traces, trimmed by
`python -m gridwright.evaluations.trim_traces`; see its README)."""
import gzip
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gridwright.analysis.trace_analysis import TraceError, analyze, format_report, kernel_class, summary_of
from gridwright.config.compose import compose_config

DATA = Path(__file__).parent / "data" / "gpu_traces"
# The overrides the committed traces were captured with (README in DATA).
CAPTURE = ["precision=bf16", "zero=stage1", "cluster=h100_x2", "model=bench_1b", "model.num_layers=2",
           "train.seq_length=2048", "train.micro_batch_size=1", "train.global_batch_size=4", "train.steps=4",
           "train.warmup_steps=1"]


def _kernel(ts, dur, **args):
    return {"ph": "X", "cat": "kernel", "name": "gemm" if not args else "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            "ts": ts, "dur": dur, "args": args}


def _comm(ts, dur, desc="DATA_PARALLEL_GROUP_WITH_CP", ranks="[0, 1]", n=1000):
    return _kernel(ts, dur, **{"Collective name": "allreduce", "Process Group Description": desc,
                               "Process Group Ranks": ranks, "In msg nelems": n, "Out msg nelems": n,
                               "dtype": "Float"})


def _write_job(tmp_path, events_by_rank, timers=None, **degrees):
    """A job directory holding a 2-rank placement (DP=2 unless `degrees` say otherwise) and
    one hand-made trace per rank."""
    from gridwright.planning.layout import ParallelLayout
    from gridwright.planning.placement import plan_placement

    layout = ParallelLayout(world_size=2, gpus_per_node=2, nvlink_domain_size=2, **degrees)
    (tmp_path / "placement.json").write_text(plan_placement(layout).to_json())
    (tmp_path / "traces").mkdir()
    for rank, events in events_by_rank.items():
        step = {"ph": "X", "cat": "user_annotation", "name": "gridwright_step_7", "ts": 0.0, "dur": 40.0}
        doc = {"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": [step, *events]}
        with gzip.open(tmp_path / "traces" / f"rank_{rank:05d}.json.gz", "wt") as f:
            json.dump(doc, f)
        if timers:
            (tmp_path / "traces" / f"rank_{rank:05d}.steps.json").write_text(json.dumps({"7": timers[rank]}))
    return tmp_path


def test_hand_made_trace_gives_the_figures_of_its_construction(tmp_path):
    # rank 0: compute [0,10) and [20,30); all-reduce [5,25): overlapped 10 of 20 us.
    # rank 1: the same all-reduce starts at 8: rank 1 arrives last, so rank 0 waited 3 us.
    job = _write_job(tmp_path, {
        0: [_kernel(0, 10), _kernel(20, 10), _comm(5, 20)],
        1: [_kernel(0, 10), _kernel(20, 10), _comm(8, 17)],
    }, timers={0: 40e-6, 1: 42e-6})
    doc = analyze(job)
    r0, r1 = doc["ranks"]["0"]["7"], doc["ranks"]["1"]["7"]
    assert r0["compute_s"] == pytest.approx(20e-6)
    assert r0["comm_s"] == pytest.approx(20e-6)
    assert r0["exposed_comm_s"] == pytest.approx(10e-6)  # [10,20)
    assert r0["idle_s"] == pytest.approx(10e-6)  # [30,40)
    assert r0["overlap_pct"] == pytest.approx(50.0)
    assert r0["wait_s"] == pytest.approx(3e-6) and r1["wait_s"] == 0.0
    assert r1["exposed_comm_s"] == pytest.approx(10e-6) and r1["overlap_pct"] == pytest.approx(100 * 7 / 17)
    assert r0["by_group"]["dp"]["bytes"] == 4000 and r0["by_kind"]["all_reduce"]["calls"] == 1
    assert r0["closure_error"] == pytest.approx(0.0, abs=1e-9)
    assert r1["closure_error"] == pytest.approx(2 / 42)
    assert doc["group_check"].startswith("every attributed")
    assert doc["stragglers"] == [{"step": 7, "slowest_rank": 0, "behind_s": 0.0, "behind_pct": 0.0, "busiest_rank": 0}]


def _launched(kernel, at, correlation):
    """The kernel and its host-side launch record, tied by the trace's correlation id."""
    kernel["args"] = {**kernel["args"], "correlation": correlation}
    return [kernel, {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": at, "dur": 1.0,
                     "args": {"correlation": correlation}}]


def test_deepspeeds_unnamed_communicators_are_attributed_by_their_members(tmp_path):
    """DeepSpeed's groups carry torch's "undefined" description and ZeRO-3 gathers over the
    default group: with no Megatron-Core name in the trace, both are the planned DP group.
    A member list that matches no planned group stays unknown, by its own name."""
    events = [_kernel(0, 10), _comm(10, 5, desc="undefined"), _comm(20, 5, desc="default_pg"),
              _comm(30, 5, desc="custom", ranks="[0, 3]")]
    doc = analyze(_write_job(tmp_path, {0: events, 1: events}))
    groups = doc["ranks"]["0"]["7"]["by_group"]
    assert groups["dp"]["calls"] == 2 and groups["dp"]["bytes"] == 8000
    assert set(groups) == {"dp", "custom"} and doc["unknown_groups"] == ["custom"]


def test_the_default_group_beside_megatrons_groups_stays_the_world(tmp_path):
    """In a Megatron-Core run the default group is not the data-parallel group, even when
    its members are the same ranks."""
    events = [_kernel(0, 10), _comm(10, 5), _comm(20, 5, desc="default_pg")]
    groups = analyze(_write_job(tmp_path, {0: events, 1: events}))["ranks"]["0"]["7"]["by_group"]
    assert groups["dp"]["calls"] == 1 and groups["world"]["calls"] == 1


def test_dynamic_cp_groups_are_reported_by_their_size(tmp_path):
    """Dynamic context parallelism runs documents on Megatron-Core's hybrid groups (and
    gridwright's own for every rank): their traffic is `cp<k>`, apart from the gradient
    reduction over the same ranks, and the per-rank compute imbalance is max/mean."""
    r0 = [_kernel(0, 12), _comm(12, 4, desc="HYBRID_DP_CP_GROUP_2"), _comm(20, 6)]
    r1 = [_kernel(0, 8), _comm(12, 4, desc="HYBRID_DP_CP_GROUP_2"), _comm(20, 6)]
    doc = analyze(_write_job(tmp_path, {0: r0, 1: r1}))
    groups = doc["ranks"]["0"]["7"]["by_group"]
    assert set(groups) == {"cp2", "dp"} and groups["cp2"]["calls"] == 1 and groups["cp2"]["exposed_s"] > 0
    assert doc["unknown_groups"] == []
    assert doc["compute_imbalance"] == pytest.approx(12 / 10)
    assert summary_of(doc)["compute_imbalance"] == pytest.approx(1.2)


@pytest.mark.parametrize("graphs", ["layers", "none"])
def test_kernels_replayed_by_layer_graphs_belong_to_the_layers_group(tmp_path, graphs):
    """A CUDA graph's NCCL kernels carry no process-group record (nothing launched them);
    with per-layer graphs at CP=2 they can only be CP's all-to-alls. Without graphs the
    same unnamed kernel stays unattributed."""
    replayed = {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 10, "dur": 5, "args": {}}
    job = _write_job(tmp_path, {0: [_kernel(0, 10), replayed], 1: [_kernel(0, 10), replayed]}, cp=2)
    cfg = compose_config(["parallel.cp=2", f"engine.cuda_graphs={graphs}"])
    (job / "config.yaml").write_text(OmegaConf.to_yaml(cfg))  # as the launcher writes it
    groups = analyze(job)["ranks"]["0"]["7"]["by_group"]
    assert set(groups) == ({"cp"} if graphs == "layers" else {"unattributed"})


def test_host_wait_is_the_idle_time_before_the_next_launch(tmp_path):
    # rank 0: kernel A [0,10) launched at -3; kernel B [20,30) launched at 16: the GPU idled
    # [10,20) and nothing was queued until 16 -> 6 us host wait. Kernel C [34,38) was launched
    # at 5, long before the gap [30,34) began: that gap waited on something else, not the host.
    # The trailing gap [38,40) has no later kernel in the trace: not counted.
    # rank 1: the same kernels without launch records (a trimmed trace): not measured.
    events = {
        0: [*_launched(_kernel(0, 10), -3, 1), *_launched(_kernel(20, 10), 16, 2), *_launched(_kernel(34, 4), 5, 3)],
        1: [_kernel(0, 10), _kernel(20, 10), _kernel(34, 4)],
    }
    job = _write_job(tmp_path, events)
    doc = analyze(job)
    r0, r1 = doc["ranks"]["0"]["7"], doc["ranks"]["1"]["7"]
    assert r0["idle_s"] == pytest.approx(16e-6) and r0["host_wait_s"] == pytest.approx(6e-6)
    assert r0["gpu_activities"] == 3 and r1["gpu_activities"] == 3  # counted without launch records too
    assert r1["idle_s"] == pytest.approx(16e-6) and r1["host_wait_s"] is None
    # one rank unmeasured: no mean, rather than a mean that counts it as zero
    assert doc["mean"]["host_wait_s"] is None and doc["mean"]["gpu_activities"] == 3
    assert "host wait" in format_report(doc)
    (tmp_path / "both").mkdir()
    both = analyze(_write_job(tmp_path / "both", {0: events[0], 1: events[0]}))
    assert both["mean"]["host_wait_s"] == pytest.approx(6e-6)


def test_a_communicator_that_is_not_the_planned_group_is_reported(tmp_path):
    job = _write_job(tmp_path, {0: [_comm(0, 5, desc="TENSOR_MODEL_PARALLEL_GROUP", ranks="[0, 1]")],
                                1: [_comm(0, 5, desc="TENSOR_MODEL_PARALLEL_GROUP", ranks="[0, 1]")]})
    doc = analyze(job)  # DP=2 plan: the TP group is each rank alone
    assert doc["group_check"] == [
        "rank 0: TENSOR_MODEL_PARALLEL_GROUP has ranks [0, 1], planned tp group [0]",
        "rank 1: TENSOR_MODEL_PARALLEL_GROUP has ranks [0, 1], planned tp group [1]",
    ]


def test_cpu_traces_are_refused_with_a_reason_and_no_nan(tmp_path):
    job = _write_job(tmp_path, {0: [], 1: []})
    doc = analyze(job)
    assert doc["available"] is False and "CPU/gloo" in doc["reason"]
    json.dumps(doc, allow_nan=False)
    assert format_report(doc).startswith("communication: not measured")
    with pytest.raises(TraceError, match="no traces"):
        analyze(tmp_path / "traces")  # not a job directory


def _bench_params(layers: int) -> int:
    from gridwright.config.compose import compose_config
    from gridwright.planning.model_math import param_counts

    return param_counts(compose_config(["model=bench_1b", f"model.num_layers={layers}"]).model).total


def test_real_dp2_trace_attributes_gradient_traffic_to_dp():
    """DP=2, distributed optimizer, overlap on, 2-layer bench model on 2 x H100."""
    doc = analyze(DATA / "dp2_overlap")
    assert doc["group_check"].startswith("every attributed") and doc["unknown_groups"] == []
    assert list(doc["mean"]["by_group"]) == ["dp"]
    # Per step: fp32 gradient reduce-scatter (4 B/param) + bf16 parameter all-gather
    # (2 B/param), over Megatron's padded buffers, plus two tiny all-reduces.
    params = _bench_params(2)
    assert doc["mean"]["by_group"]["dp"]["bytes"] == pytest.approx(6 * params, rel=2e-3)
    r0 = doc["ranks"]["0"]["3"]
    assert {k: v["calls"] for k, v in r0["by_kind"].items()} == {"all_gather": 4, "all_reduce": 2, "reduce_scatter": 4}
    # Exact figures of these committed traces (microsecond resolution).
    assert round(r0["step_s"] * 1e6) == 42784
    assert round(r0["compute_s"] * 1e6) == 18599
    assert round(r0["exposed_comm_s"] * 1e6) == 2149
    assert round(doc["mean"]["overlap_pct"], 2) == 27.04


def test_kernels_are_classed_by_name():
    assert kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_class("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "matmul"
    assert kernel_class("triton_tem_fused_mm_0") == "matmul"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert kernel_class("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>") == "other"
    assert kernel_class("triton_poi_fused__to_copy_mul_silu_0") == "other"


def test_real_trace_splits_compute_into_matmul_attention_and_the_rest():
    """The classes cover compute: each is at most the union of all compute, and together
    (they may overlap on different streams) at least it."""
    m = analyze(DATA / "dp2_overlap")["mean"]
    by = m["compute_by_class_s"]
    assert set(by) == {"matmul", "attention", "other"}
    assert all(0 < v <= m["compute_s"] for v in by.values())
    assert sum(by.values()) >= m["compute_s"] * (1 - 1e-9)
    assert round(by["matmul"] * 1e6) == 5552 and round(by["attention"] * 1e6) == 794


@pytest.mark.parametrize("case", ["dp2_overlap", "tp2_sp", "pp2"])
def test_real_traces_close_against_the_step_timer_on_every_rank(case):
    """compute + exposed communication + idle = the timer's step, within 5 %, on every rank."""
    doc = analyze(DATA / case)
    errors = [rec["closure_error"] for steps in doc["ranks"].values() for rec in steps.values()]
    assert len(errors) == 4 and max(errors) < 0.05
    assert doc["max_closure_error"] == max(errors)


def test_real_tp2_sp_trace_puts_sequence_parallel_traffic_on_tp():
    doc = analyze(DATA / "tp2_sp")
    tp = doc["mean"]["by_group"]["tp"]
    assert tp["comm_s"] > 10 * doc["mean"]["by_group"]["dp"]["comm_s"]
    calls = {k: v["calls"] for k, v in doc["ranks"]["1"]["2"]["by_kind"].items()}
    assert calls == {"all_gather": 60, "all_reduce": 14, "reduce_scatter": 40}
    # The alpha-beta model's call list for this layout predicts the traced TP traffic exactly.
    from collections import Counter

    from gridwright.planning.comm_model import predict_step_communication
    from gridwright.config.compose import compose_config
    from gridwright.planning.layout import ParallelLayout

    cfg = compose_config(CAPTURE + ["parallel.tp=2", "parallel.sp=true"])
    predicted = predict_step_communication(cfg, ParallelLayout.from_config(cfg))["tp"]
    counts = Counter()
    for call in predicted["calls"]:
        counts[call["collective"]] += call["count"]
    assert counts["all_gather"] == 60 and counts["reduce_scatter"] == 40
    assert predicted["bytes"] == tp["bytes"] == 839_000_064
    s = summary_of(doc)
    assert set(s["by_group"]) == {"dp", "tp"} and not any(
        isinstance(v, float) and math.isnan(v) for v in s.values())


def test_real_pp2_trace_attributes_p2p_to_pp_without_inventing_sizes():
    doc = analyze(DATA / "pp2")
    pp = doc["mean"]["by_group"]["pp"]
    assert pp["calls"] == 5 and pp["bytes"] is None and pp["wait_s"] is None
    assert "n/a" in format_report(doc)
