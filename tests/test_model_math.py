"""Parameter counts and the FLOP formula behind MFU, against published numbers."""
import pytest

from gridwright.layout import ParallelLayout
from gridwright.memory_estimate import estimate_memory
from gridwright.model_math import forward_flops_per_token, model_flops_per_token, param_counts


def test_published_parameter_counts(compose):
    assert param_counts(compose("model=llama3_8b").model).total == pytest.approx(8.03e9, rel=0.005)
    assert param_counts(compose("model=llama3_70b").model).total == pytest.approx(70.6e9, rel=0.005)
    assert param_counts(compose("model=mixtral_8x7b").model).total == pytest.approx(46.7e9, rel=0.005)


def test_flops_formula_by_hand(compose):
    m = compose("model=llama3_8b").model
    h, f, L, V, s = 4096, 14336, 32, 128256, 8192
    attn = h * (32 + 2 * 8) * 128 + 32 * 128 * h
    expected_forward = 2 * (L * (attn + 3 * h * f) + h * V) + 4 * L * s * h
    assert forward_flops_per_token(m, s) == expected_forward
    assert model_flops_per_token(m, s) == 3 * expected_forward


def test_moe_counts_only_active_experts(compose):
    m = compose("model=mixtral_8x7b").model
    dense_equivalent = 2 * 3 * 4096 * 14336 * 32  # 2 experts of 3 matrices, 32 layers
    total_experts = 8 * 3 * 4096 * 14336 * 32
    fwd = forward_flops_per_token(m, 4096)
    assert 2 * dense_equivalent < fwd < 2 * total_experts


def test_zero_stages_shrink_memory_in_order(compose):
    totals = []
    for stage in (0, 1, 2, 3):
        cfg = compose("+experiment=llama3_8b", f"zero=stage{stage}")
        est = estimate_memory(cfg, ParallelLayout.from_config(cfg))
        totals.append((est.weights_gib, est.grads_gib, est.optimizer_gib))
    (w0, g0, o0), (w1, g1, o1), (w2, g2, o2), (w3, g3, o3) = totals
    assert o1 == pytest.approx(o0 / 8) and g1 == g0 and w1 == w0
    assert g2 == pytest.approx(g0 / 8) and w2 == w0
    assert w3 == pytest.approx(w0 / 8)


def test_recompute_shrinks_activations(compose):
    acts = {}
    for r in ("none", "full"):
        cfg = compose("+experiment=llama3_8b", f"train.recompute={r}")
        acts[r] = estimate_memory(cfg, ParallelLayout.from_config(cfg)).activations_gib
    assert acts["full"] < acts["none"] / 5


def test_llama3_8b_weights_by_hand(compose):
    """bf16 weights of Llama-3-8B at TP=2: 8.03e9 * 2 bytes / 2 = 7.5 GiB."""
    cfg = compose("+experiment=llama3_8b")
    est = estimate_memory(cfg, ParallelLayout.from_config(cfg))
    assert est.weights_gib == pytest.approx(8.03e9 * 2 / 2 / 2**30, rel=0.02)
