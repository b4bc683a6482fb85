"""Family declarations: well-formed, and the head size read and written back in one form."""
import pytest

from gridwright.checkpoints.checkpoint_dir import model_differences
from gridwright.families import weight_table
from gridwright.families.hf_config import model_config_from_hf, same_model, transformers_config
from gridwright.families.registry import FAMILIES

SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             vocab_size=128, max_position_embeddings=256, rotary_base=10000.0, norm_epsilon=1e-6,
             tie_embeddings=False, rope_scaling_factor=None, moe_router_topk=2, moe_aux_loss_coeff=0.01)


def model(family: str, **changes) -> dict:
    fam = FAMILIES[family]
    return {**SHAPE, "name": "m", "family": family, "head_dim": None, "num_experts": 4 if fam.experts else 0,
            "qkv_bias": False, **fam.fixed, **changes}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_declaration_expands_and_names_a_tiny_model(family):
    """Every row has a known Megatron-Core shape, every family a tiny model for the tests,
    and each Hugging Face tensor is named once."""
    pieces = weight_table.pieces(model(family))
    names = [n for p in pieces for n in p.hf_names]
    assert len(names) == len(set(names)) and FAMILIES[family].tiny


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_the_head_size_is_written_back_whatever_the_config_class_defaults_to(family):
    """Stored as None (hidden / heads), it is exported as hidden / heads: Qwen3's config
    class would otherwise write its own default of 128, and the export would not load."""
    import transformers

    def q_rows(config) -> int:  # what the Hugging Face model builds from the written config
        return transformers.AutoModelForCausalLM.from_config(config).model.layers[0].self_attn.q_proj.weight.shape[0]

    config = transformers_config(model(family))
    assert q_rows(config) == 4 * 16
    assert model_config_from_hf(dict(config.to_dict()), "m")["head_dim"] is None
    assert q_rows(transformers_config(model(family, head_dim=32))) == 4 * 32


def test_a_record_from_before_head_dim_is_the_same_model():
    """A checkpoint recorded before model.head_dim existed, or with the size written out,
    is the same model (its kept config.json is exported; a resume is not refused)."""
    now = model("llama")
    old = {k: v for k, v in now.items() if k != "head_dim"}
    assert same_model(old, now) and same_model(dict(now, head_dim=16), now)
    assert not same_model(dict(now, head_dim=32), now)
    assert model_differences(dict(now, head_dim=None), dict(now, head_dim=16)) == []
    assert model_differences(dict(now, head_dim=32), now) == ["model.head_dim=16 (checkpoint: 32)"]


def test_a_fixed_field_is_held_to_its_value():
    from gridwright.families.hf_config import family_problems

    assert family_problems(model("qwen2")) == []
    assert family_problems(model("qwen2", qkv_bias=False)) == [
        "model.family=qwen2 with model.qkv_bias=False: the qwen2 family has qkv_bias=True. Fix: model.qkv_bias=true."]
    assert "is a mixture of experts" in family_problems(model("qwen3_moe", num_experts=0))[0]
