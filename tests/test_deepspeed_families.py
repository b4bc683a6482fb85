"""Qwen2, Qwen3, Qwen3-MoE and Mistral under the DeepSpeed engine against the Megatron
engine: from the same Hugging Face folder (fp32, 2 CPU processes, DP=2), ZeRO-1 and ZeRO-3
follow the Megatron engine's loss and gradient norm step by step, and both learn. What each family adds to
Llama is exercised by its tiny model: Qwen2's q/k/v biases and tied embeddings, Qwen3's
per-head QK-norm with a head size other than hidden / heads, Qwen3-MoE's experts with
Megatron-Core's load-balancing loss, Mistral as Llama under another class. Few steps of
the smallest models: every run is a real torchrun. Then, in process: a default run's
initial weights, and the refusals that keep the Hugging Face path equal to Megatron's."""
import pytest
import torch
from test_deepspeed_runs import deepspeed_run_from_hf, megatron_run_from_hf

STEPS = 8
FAMILIES = {
    "qwen2": (),
    "qwen3": (),
    "qwen3_moe": ("parallel.moe_token_dispatcher=allgather",),  # alltoall needs CUDA in Megatron-Core 0.16.1
    "mistral": (),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def start(request, tmp_path_factory):
    family = request.param
    return megatron_run_from_hf(tmp_path_factory.mktemp(family), family, *FAMILIES[family], f"train.steps={STEPS}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_each_family_follows_the_megatron_engine_step_by_step_and_learns(start, stage):
    want_loss, want_norm = start[3]
    loss, norm = deepspeed_run_from_hf(start, f"zero{stage}", f"zero=stage{stage}")
    assert len(loss) == STEPS
    assert want_loss[-1] < want_loss[0] - 0.3 and loss[-1] < loss[0] - 0.3  # both learn
    assert loss == pytest.approx(want_loss, rel=1e-3)  # measured: within 2e-7 for every family and stage
    # Exact over these steps (measured within 5e-7; Qwen3-MoE too, its load-balancing
    # loss included), as Mixtral's first 8 (test_deepspeed_mixtral.py).
    assert norm == pytest.approx(want_norm, rel=1e-5)


# In-process checks of the same path (no torchrun): the model config of each family's
# tiny model as the converter would write it.
MODEL = {
    "qwen2": ["model.family=qwen2", "model.qkv_bias=true", "model.tie_embeddings=true"],
    "qwen3": ["model.family=qwen3", "model.head_dim=32", "model.tie_embeddings=true"],
    "qwen3_moe": ["model=tiny_mixtral", "model.family=qwen3_moe", "model.head_dim=32"],
    "mistral": ["model.family=mistral"],
}


@pytest.mark.parametrize("family", sorted(MODEL))
def test_a_default_run_draws_each_familys_weights_by_megatrons_rules(compose, family):
    """Without initial weights: norm scales (Qwen3's q_norm/k_norm too) start at one,
    Qwen2's q/k/v biases at zero, residual-output projections (experts' fused down_proj
    too) at Megatron-Core's scaled-down std, every other matrix at init_method_std."""
    import math

    import transformers
    from gridwright.engines.hf_model import hf_config, initialise_as_megatron
    from gridwright.planning.layout import ParallelLayout

    cfg = compose(*MODEL[family])
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # anything the rules miss stands out
    initialise_as_megatron(model, cfg, ParallelLayout.from_config(cfg))
    names = dict(model.named_parameters())
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == family.startswith("qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    residual_std = 0.02 / math.sqrt(2 * cfg.model.num_layers)
    for name, p in names.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            want = residual_std if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 0.02
            assert p.mean().item() == pytest.approx(0.0, abs=want / 5), name
            assert p.std().item() == pytest.approx(want, rel=0.15), name


def test_a_qwen3_moe_router_the_hugging_face_class_would_not_reproduce_is_refused(compose, monkeypatch):
    """Megatron-Core's top-k-then-softmax is Qwen3-MoE's norm_topk_prob=true: a family
    declaring softmax-then-top-k (moe_router_pre_softmax) would route differently."""
    import dataclasses

    from gridwright.engines import hf_model
    from gridwright.families import registry
    from gridwright.families.declaration import UnsupportedModel

    cfg = compose(*MODEL["qwen3_moe"])
    assert hf_model.hf_config(cfg.model).norm_topk_prob is True
    fam = registry.FAMILIES["qwen3_moe"]
    monkeypatch.setitem(registry.FAMILIES, "qwen3_moe",
                        dataclasses.replace(fam, megatron={**fam.megatron, "moe_router_pre_softmax": True}))
    hf_model.megatron_router.cache_clear()
    try:
        with pytest.raises(UnsupportedModel, match="moe_router_pre_softmax=True against Hugging Face's norm_topk_prob"):
            hf_model.hf_config(cfg.model)
    finally:
        hf_model.megatron_router.cache_clear()


def test_a_mistral_folder_with_a_sliding_window_is_refused_not_run_with_full_attention(tmp_path):
    """The model config has no window, so loading such a folder would silently compute
    another model; it is refused with the converter's reason."""
    import json

    from gridwright.adapters.tiny_models import make_tiny_model
    from gridwright.engines.hf_model import load_hf_model
    from gridwright.families.declaration import UnsupportedModel

    hf = make_tiny_model("mistral", tmp_path / "mistral")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, sliding_window=16)))
    with pytest.raises(UnsupportedModel, match="sliding_window=16"):
        load_hf_model(hf, None)
