"""The alpha-beta model of collectives, the profile file, the step's communication by hand,
and one real run of the collectives benchmark on two CPU processes over gloo."""
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from gridwright.planning.comm_model import (
    FORMAT,
    CommProfile,
    UnmeasuredGroupSize,
    alg_bandwidth,
    bus_bandwidth,
    bus_factor,
    fit_alpha_beta,
    plot_profile,
    predict_step_communication,
)
from gridwright.evaluations.bench_collectives import (
    actual_size,
    consecutive_partitions,
    message_sizes,
    parse_bytes,
    partitions_from_placement,
)
from gridwright.planning.layout import ParallelLayout
from gridwright.planning.placement import plan_placement

from conftest import REPO

SIZES = [2**k for k in range(10, 31)]  # 1 KiB .. 1 GiB, as the benchmark's default


# Bandwidth arithmetic --------------------------------------------------------------------
def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == bus_factor("all_to_all", 8) == 0.875
    assert bus_factor("send_recv", 8) == 1.0
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="broadcast"):
        bus_factor("broadcast", 8)
    # 1 GiB all-reduce over 8 ranks in 10 ms: algbw 107.4 GB/s, busbw x 1.75
    assert alg_bandwidth(2**30, 0.01) == pytest.approx(107.374e9, rel=1e-4)
    assert bus_bandwidth("all_reduce", 8, 2**30, 0.01) == pytest.approx(187.904e9, rel=1e-4)


# The fit ------------------------------------------------------------------------------
ALPHA, BUSBW = 25e-6, 150e9  # 25 us latency, 150 GB/s bus bandwidth


def _times(collective, n, sizes, alpha=ALPHA, busbw=BUSBW):
    return np.array([alpha + s * bus_factor(collective, n) / busbw for s in sizes])


def test_fit_recovers_exact_alpha_beta():
    fit = fit_alpha_beta(SIZES, _times("all_reduce", 8, SIZES), "all_reduce", 8)
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(1 / BUSBW, rel=1e-9)
    assert fit.rms_rel_error < 1e-9 and fit.num_points == len(SIZES)
    assert fit.seconds(2**20) == pytest.approx(ALPHA + 2**20 * 1.75 / BUSBW, rel=1e-9)


@pytest.mark.parametrize("collective,n", [("all_reduce", 8), ("all_gather", 4), ("send_recv", 2)])
def test_fit_with_three_percent_noise(collective, n):
    rng = np.random.default_rng(0)
    t = _times(collective, n, SIZES) * (1 + 0.03 * rng.standard_normal(len(SIZES)))
    fit = fit_alpha_beta(SIZES, t, collective, n)
    # Both ends count: the latency comes from the small sizes, the bandwidth from the large.
    assert fit.alpha_s == pytest.approx(ALPHA, rel=0.05)
    assert fit.beta_s_per_byte == pytest.approx(1 / BUSBW, rel=0.05)
    assert 0.015 < fit.rms_rel_error < 0.05


def test_fit_clamps_to_physical_parameters():
    big = [2**k for k in range(22, 31)]
    # The line through these crosses zero near 300 KiB (a negative latency): alpha -> 0.
    t = _times("all_reduce", 2, big, alpha=-2e-6)
    fit = fit_alpha_beta(big, t, "all_reduce", 2)
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte > 0
    assert fit.beta_s_per_byte == pytest.approx(1 / BUSBW, rel=0.05)
    # Never bandwidth-bound (times do not grow): beta -> 0, alpha the typical time.
    flat = fit_alpha_beta([1024, 2048, 4096], [30e-6, 29e-6, 28e-6], "all_gather", 2)
    assert flat.beta_s_per_byte == 0.0 and flat.alpha_s == pytest.approx(29e-6, rel=0.02)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_alpha_beta([1024, 1024], [1e-5, 1e-5], "all_reduce", 2)


# The profile file ---------------------------------------------------------------------------
def _points(n, alpha, busbw, colls=("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")):
    sizes = [2**k for k in range(10, 27, 2)]
    return {c: {n: list(zip(sizes, _times(c, n, sizes, alpha, busbw).tolist()))} for c in colls}


def test_profile_round_trip(tmp_path):
    fast, slow = _points(2, 5e-6, 300e9), _points(2, 20e-6, 25e9)
    profile = CommProfile.from_points(
        "NVIDIA H100 80GB HBM3", "nccl", 8, {},
        kinds={"tp": (2, 4, fast), "dp_cp": (2, 4, slow)}, meta={"source": "test"},
    )
    # By size alone the slower kind answers (never optimistic); by kind, its own fit.
    assert profile.meta["size_table_from"]["all_reduce"]["2"] == "dp_cp"
    assert profile.seconds("all_reduce", 2, 2**20) == pytest.approx(20e-6 + 2**20 / 25e9, rel=1e-6)
    assert profile.seconds("all_reduce", 2, 2**20, kind="tp") == pytest.approx(5e-6 + 2**20 / 300e9, rel=1e-6)
    path = profile.save(tmp_path / "sub" / "profile.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT == "gridwright-comm-profile/1"
    assert doc["fits"]["all_reduce"]["2"]["bus_bandwidth_GBps"] == pytest.approx(25.0, rel=1e-6)
    assert not list(path.parent.glob(".*tmp"))  # the atomic write left no temporary file
    back = CommProfile.load(path)
    assert (back.device, back.backend, back.world_size) == ("NVIDIA H100 80GB HBM3", "nccl", 8)
    assert back.fits == profile.fits and back.points == profile.points
    assert back.kinds["tp"].fits == profile.kinds["tp"].fits and back.kinds["tp"].num_groups == 4
    assert back.seconds("send_recv", 2, 4096, kind="tp") == profile.seconds("send_recv", 2, 4096, kind="tp")
    with pytest.raises(UnmeasuredGroupSize, match=r"groups of 4 ranks \(measured group sizes: 2\)"):
        back.seconds("all_reduce", 4, 2**20)
    doc["format"] = "something-else/9"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="gridwright-comm-profile/1"):
        CommProfile.load(tmp_path / "bad.json")


def test_plot_profile(tmp_path):
    profile = CommProfile.from_points("cpu", "gloo", 4, {**_points(2, 50e-6, 2e9)})
    out = plot_profile(profile, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# One step's communication, by hand ----------------------------------------------------------
# tiny_llama: 4 layers, h 64, ffn 176, 4 heads (head_dim 16), 2 KV groups, vocab 256; train
# seq 64, micro-batch 2, global batch 8; fp32 unless said otherwise.
# Parameters per layer: QKV 64 x (4 + 2 x 2) x 16 = 8,192; projection 4,096; SwiGLU 3 x 64 x
# 176 = 33,792; norms 128. Embedding = output = 256 x 64 = 16,384; final norm 64.
LAYER = 8192 + 4096 + 33792 + 128  # 46,208
WHOLE = 4 * LAYER + 2 * 16384 + 64  # 217,664 parameters on one rank without TP/PP
A = 64 * 2 * 64 * 4  # s x b x h x 4 bytes = 32,768


def _predict(compose, *overrides, profile=None):
    cfg = compose(*overrides)
    return predict_step_communication(cfg, ParallelLayout.from_config(cfg), profile)


def _tally(kind_entry) -> Counter:
    """(collective, size) -> calls per step."""
    out = Counter()
    for c in kind_entry["calls"]:
        out[(c["collective"], c["size_bytes"])] += c["count"]
    return out


def test_dp2_stage0_one_all_reduce_of_fp32_gradients(compose):
    r = _predict(compose)
    assert set(r) == {"dp"} and r["dp"]["group_size"] == 2 and r["dp"]["placement_kind"] == "dp_cp"
    assert _tally(r["dp"]) == {("all_reduce", WHOLE * 4): 1, ("all_reduce", 4): 1}  # + the logged loss
    assert r["dp"]["bytes"] == 870_656 + 4 and r["dp"]["seconds"] is None


def test_dp2_stage1_reduce_scatter_and_param_all_gather(compose):
    r = _predict(compose, "zero=stage1", "precision=bf16")
    # gradients in fp32 (grad_reduce_in_fp32), parameters gathered in bf16
    assert _tally(r["dp"]) == {
        ("reduce_scatter", WHOLE * 4): 1, ("all_gather", WHOLE * 2): 1, ("all_reduce", 4): 1,
    }
    # overlap_grad_reduce turns on Megatron's buckets: 217,664 = 2 x 100,000 + 17,664
    r = _predict(compose, "zero=stage1", "precision=bf16", "engine.overlap_grad_reduce=true",
                 "engine.bucket_size=100000")
    assert _tally(r["dp"]) == {
        ("reduce_scatter", 400_000): 2, ("reduce_scatter", 70_656): 1,
        ("all_gather", 200_000): 2, ("all_gather", 35_328): 1, ("all_reduce", 4): 1,
    }
    # default bucket max(40M, 1M x DP) holds all of it
    r = _predict(compose, "zero=stage1", "engine.overlap_grad_reduce=true")
    assert _tally(r["dp"])[("reduce_scatter", WHOLE * 4)] == 1


def test_dp2_stage3_fsdp_gathers_every_micro_batch(compose):
    # Megatron-FSDP: per micro-batch (2), each layer (a unit) and the rest (embedding, output,
    # final norm: 32,832) gathered for forward and backward, gradients reduce-scattered.
    r = _predict(compose, "zero=stage3")
    rest = 2 * 16384 + 64
    assert _tally(r["dp"]) == {
        ("all_gather", LAYER * 4): 4 * 2 * 2, ("reduce_scatter", LAYER * 4): 4 * 2,
        ("all_gather", rest * 4): 2 * 2, ("reduce_scatter", rest * 4): 2, ("all_reduce", 4): 1,
    }


def test_tp2_without_sp(compose):
    # DP = 1, 4 micro-batches; 4 layers x 4 micro-batches x (2 forward + 2 backward) = 64,
    # + embedding 4 + output layer input gradient 4; cross-entropy 3 x 4 of s x b fp32 = 512 B.
    r = _predict(compose, "parallel.tp=2")
    assert set(r) == {"tp"}
    assert _tally(r["tp"]) == {("all_reduce", A): 72, ("all_reduce", 512): 12}
    assert r["tp"]["bytes"] == 72 * A + 12 * 512 == 2_365_440


def test_tp2_with_sp(compose):
    # per layer and micro-batch: forward 2 AG + 2 RS, backward 4 AG + 2 RS (16 x);
    # embedding RS + AG, output layer AG + AG + RS (4 micro-batches each); SP weights'
    # gradient all-reduce once: (2 x 64 x 4 + 64) x 4 bytes = 2,304.
    r = _predict(compose, "parallel.tp=2", "parallel.sp=true")
    assert _tally(r["tp"]) == {
        ("all_gather", A): 16 * 6 + 4 + 4 + 4,
        ("reduce_scatter", A): 16 * 4 + 4 + 4,
        ("all_reduce", 512): 12,
        ("all_reduce", 2_304): 1,
    }
    profile = CommProfile.from_points("x", "nccl", 2, {**_points(2, 10e-6, 100e9)})
    r = _predict(compose, "parallel.tp=2", "parallel.sp=true", profile=profile)
    expected = (108 + 72) * (10e-6 + A * 0.5 / 100e9) + 12 * (10e-6 + 512 / 100e9) + (10e-6 + 2304 / 100e9)
    assert r["tp"]["seconds"] == pytest.approx(expected, rel=1e-6)
    assert sum(c["seconds"] for c in r["tp"]["calls"]) == pytest.approx(expected, rel=1e-9)


def test_pp2_first_stage_sends_activations_and_receives_gradients(compose):
    r = _predict(compose, "parallel.pp=2")
    assert set(r) == {"pp"}
    assert _tally(r["pp"]) == {("send_recv", A): 4 + 4}
    # VPP=2 (one layer a chunk): forward 2 sends + 1 receive, backward 2 receives + 1 send
    r = _predict(compose, "parallel.pp=2", "parallel.vpp=2")
    assert _tally(r["pp"]) == {("send_recv", A): 4 * 6}
    # SP shortens the p2p tensor to s/tp; DP=1 on 4 ranks
    r = _predict(compose, "parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "cluster.gpus_per_node=4")
    assert _tally(r["pp"]) == {("send_recv", A // 2): 8}


def test_cp2_gathers_keys_and_values(compose):
    # K or V of the whole sequence: 64 x 2 x 2 groups x 16 x 4 B = 16,384; 16 layer passes.
    r = _predict(compose, "parallel.cp=2")
    kv = 64 * 2 * 2 * 16 * 4
    assert _tally(r["cp"]) == {("all_gather", kv): 2 * 16, ("all_reduce", kv): 2 * 16, ("all_reduce", 4): 4}
    # the DP group of Megatron's gradients includes CP (dp_cp): 2 ranks
    assert r["dp"]["group_size"] == 2 and _tally(r["dp"])[("all_reduce", WHOLE * 4)] == 1
    r = _predict(compose, "parallel.cp=2", "train.recompute=selective")
    assert _tally(r["cp"])[("all_gather", kv)] == 4 * 16


def test_cp2_all_to_all_exchanges_queries_keys_values_and_outputs(compose):
    # Per rank s/cp = 32 positions: Q, K and V of 4 heads + 2 x 2 groups, 32 x 2 x 8 x 16 x 4 B
    # = 32,768 sent; the output 32 x 2 x 4 x 16 x 4 B = 16,384; each in the forward and, as
    # gradients, in the backward, over 16 layer passes.
    r = _predict(compose, "parallel.cp=2", "parallel.cp_comm_type=a2a")
    assert _tally(r["cp"]) == {("all_to_all", 32768): 2 * 16, ("all_to_all", 16384): 2 * 16, ("all_reduce", 4): 4}
    r = _predict(compose, "parallel.cp=2", "parallel.cp_comm_type=a2a", "train.recompute=selective")
    assert _tally(r["cp"]) == {("all_to_all", 32768): 3 * 16, ("all_to_all", 16384): 3 * 16, ("all_reduce", 4): 4}


def test_ep2_mixtral_alltoall(compose):
    # tiny_mixtral: 2 layers, 4 experts top-2, h 64, ffn 128; DP 2 -> 2 micro-batches.
    # T = 64 x 2 = 128 tokens: routed tokens 128 x 2 x 64 x 4 B = 65,536, probabilities 1,024.
    r = _predict(compose, "+experiment=tiny_mixtral_cpu", "parallel.moe_token_dispatcher=alltoall")
    assert set(r) == {"dp", "ep"}  # expert DP = 1
    per = 2 * 2
    assert _tally(r["ep"]) == {
        ("all_to_all", 65_536): 4 * per,  # dispatch + combine, forward and backward
        ("all_to_all", 1_024): 2 * per,
        ("all_gather", 4 * 8 * 2): per,  # tokens-per-expert counts
    }
    # dense: attention 12,288 + norms 128 + router 256 per layer, embedding, output, final norm
    assert _tally(r["dp"])[("all_reduce", (2 * (12_288 + 128 + 256) + 2 * 16_384 + 64) * 4)] == 1
    # 4 ranks: expert DP 2 reduces the experts, 2 layers x 2 of 4 experts x 3 x 64 x 128
    r = _predict(compose, "+experiment=tiny_mixtral_cpu", "parallel.moe_token_dispatcher=alltoall",
                 "cluster.gpus_per_node=4")
    assert r["edp"]["group_size"] == 2
    assert _tally(r["edp"]) == {("all_reduce", 2 * 2 * 3 * 64 * 128 * 4): 1}


def test_ep2_mixtral_allgather_dispatcher(compose):
    r = _predict(compose, "+experiment=tiny_mixtral_cpu")
    per, n, T = 4, 2, 128
    assert _tally(r["ep"]) == {
        ("all_gather", n * T * 4): per,  # routing map, bools
        ("all_gather", n * T * 4 * 4): per,  # probabilities
        ("all_gather", n * T * 64 * 4): 2 * per,  # tokens; combine's gradient
        ("reduce_scatter", n * T * 64 * 4): 2 * per,  # combine; tokens' gradient
        ("reduce_scatter", n * T * 4 * 4): per,  # probabilities' gradient
    }


def test_unmeasured_group_size_is_a_clear_error(compose):
    profile = CommProfile.from_points("x", "nccl", 2, {**_points(2, 10e-6, 100e9)})
    with pytest.raises(UnmeasuredGroupSize, match=r"all_reduce fit for groups of 4 ranks .*: 2\)"):
        _predict(compose, "parallel.tp=4", "cluster.gpus_per_node=4", profile=profile)


# The benchmark --------------------------------------------------------------------------
def test_benchmark_group_plans():
    assert message_sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert [parse_bytes(t) for t in ("1024", "2**30", "64K", "16MiB", "1G")] == [1024, 2**30, 2**16, 2**24, 2**30]
    assert actual_size("all_gather", 1000, 8) == 992  # whole float32 elements, n of them
    assert actual_size("all_gather", 16, 8) == 32  # at least one element a rank
    assert actual_size("all_reduce", 1030, 8) == 1028
    assert [len(p[0]) for _, p in consecutive_partitions(6)] == [2, 4, 6]
    assert consecutive_partitions(6)[1][1] == [[0, 1, 2, 3]]  # ranks 4, 5 sit out
    doc = json.loads(plan_placement(ParallelLayout(8, 8, 8, tp=2, pp=2, etp=2)).to_json())
    parts = {tuple(kinds): groups for kinds, groups in partitions_from_placement(doc)}
    # kinds with identical groups are timed once: etp = tp, dp = dp_cp = edp (no CP, EP)
    assert parts[("tp", "etp", "etp_ep")] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parts[("dp", "dp_cp", "edp")] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert parts[("pp",)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parts[("mp",)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert ("cp",) not in parts and ("ep",) not in parts  # groups of one rank


@pytest.mark.slow
def test_benchmark_runs_on_two_cpu_processes(tmp_path):
    out = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "gridwright.evaluations.bench_collectives", "--out", str(out), "--device", "cpu",
         "--min-bytes", "1K", "--max-bytes", "16M", "--factor", "4", "--iters", "4", "--warmup", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "busbw(GB/s)" in proc.stdout and "# send_recv on groups of 2" in proc.stdout
    profile = CommProfile.load(out)
    assert profile.backend == "gloo" and profile.world_size == 2
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        fit = profile.fits[coll][2]
        assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0, (coll, fit)
        assert [s for s, _ in profile.points[coll][2]] == [1024 * 4**k for k in range(8)]
