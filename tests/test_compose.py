"""Hydra composition: groups, presets and the typed schema."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from gridwright.basics.conf_dir import CONF_DIR, PRESET_GROUPS

PRESETS = [(group, path.stem) for group in PRESET_GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


def test_default_is_tiny_llama_on_two_cpu_processes(compose):
    cfg = compose()
    assert cfg.model.name == "tiny_llama"
    assert cfg.cluster.device == "cpu" and cfg.cluster.gpus_per_node == 2
    assert cfg.engine.name == "megatron" and cfg.launcher.name == "local"
    assert cfg.tracking.uri.startswith("sqlite:///")


def test_the_users_presets_and_the_benchmarks_are_separate_groups():
    assert {name for group, name in PRESETS if group == "experiment"} == {
        "tiny_llama_cpu", "tiny_llama_tp2", "tiny_llama_pp2", "tiny_mixtral_cpu", "mixtral_ep8", "llama3_8b",
        "llama3_70b", "llama3_8b_tp8", "llama3_8b_dp8"}
    assert all(name.startswith(("bench_", "eval_", "engines_")) for group, name in PRESETS if group == "bench")


@pytest.mark.parametrize("group, name", PRESETS)
def test_every_preset_composes_and_validates(compose, group, name):
    from gridwright.validation.validate import validate

    # the engines comparison's points start from weights `same_weights` writes first
    weights = ["checkpoint.load=null"] if name.startswith("engines_") else []
    cfg = compose(f"+{group}={name}", *weights)
    # a user's preset names the run after itself; a benchmark's points share their sweep's name
    assert cfg.name == name if group == "experiment" else cfg.name.startswith(("bench_", "eval_", "engines_"))
    placement = validate(cfg, for_launch=False).placement
    assert placement.world_size == cfg.cluster.nodes * cfg.cluster.gpus_per_node


def test_published_shapes(compose):
    cfg = compose("+experiment=mixtral_ep8")
    assert (cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_experts) == (4096, 14336, 8)
    assert cfg.parallel.ep == 8
    cfg = compose("model=llama3_70b")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_query_groups) == (80, 8192, 8)


def test_misspelt_key_is_an_error(compose):
    with pytest.raises(ConfigCompositionException, match="tpp"):
        compose("parallel.tpp=2")


def test_wrong_type_is_an_error(compose):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose("parallel.tp=two")


def test_unknown_group_option_is_an_error(compose):
    with pytest.raises(ConfigCompositionException, match="precision"):
        compose("precision=fp7")


def test_misspelt_key_in_a_group_file_is_an_error(tmp_path, monkeypatch):
    """A typo inside a YAML file (not only on the command line) is caught by the schema."""
    import shutil

    from gridwright.config import compose as compose_mod

    conf = tmp_path / "conf"
    shutil.copytree(compose_mod.CONF_DIR, conf)
    (conf / "model" / "typo.yaml").write_text("name: typo\nnum_layers: 2\nhiden_size: 64\n")
    monkeypatch.setattr(compose_mod, "CONF_DIR", conf)
    with pytest.raises(ConfigCompositionException):
        compose_mod.compose_config(["model=typo"])


def test_fp8_recipes_map_to_transformer_config(compose):
    """TE cannot run here; the FP8 path is checked through the TransformerConfig it produces."""
    from megatron.core.transformer import TransformerConfig

    from gridwright.engines.megatron_model import transformer_config_kwargs
    from gridwright.planning.layout import ParallelLayout

    for preset, recipe, fmt in (
        ("fp8_delayed", "delayed", "hybrid"),
        ("fp8_tensorwise", "tensorwise", "hybrid"),
        ("fp8_blockwise", "blockwise", "e4m3"),
        ("mxfp8", "mxfp8", "e4m3"),
    ):
        cfg = compose("+bench=bench_gpu", f"precision={preset}")
        kw = transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg))
        # TE's fused rotary kernel for TE's layers (TransformerConfig refuses it where TE is absent)
        assert kw.pop("apply_rope_fusion") is True
        tc = TransformerConfig(**kw)
        assert (tc.fp8, tc.fp8_recipe, tc.bf16) == (fmt, recipe, True)
    cfg = compose("+bench=bench_gpu", "precision=fp8_delayed")
    kw = transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg))
    kw.pop("apply_rope_fusion")
    tc = TransformerConfig(**kw)
    assert tc.fp8_amax_history_len == 1024 and tc.fp8_amax_compute_algo == "max"
    cfg = compose("+bench=bench_gpu")
    kw = transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg), te_available=False)
    assert kw["apply_rope_fusion"] is False and TransformerConfig(**kw).fp8 is None
    # Without Transformer Engine, torchao runs tensorwise inside the layers: no TE FP8 in the config
    cfg = compose("+bench=bench_gpu", "precision=fp8_tensorwise")
    assert "fp8" not in transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg), te_available=False)


def test_cp_comm_type_reaches_core_attention_and_leaves_te_its_ring(compose):
    """Megatron-Core hands TransformerConfig.cp_comm_type to each layer's core attention.
    gridwright's torch attention gets the form asked for; Transformer Engine (not importable
    here: checked through the kwargs) keeps its default ring unless all-to-all is asked."""
    from gridwright.engines.megatron_model import transformer_config_kwargs
    from gridwright.planning.layout import ParallelLayout

    def kwargs(te: bool, *overrides):
        cfg = compose("parallel.cp=2", *overrides)
        return transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg), te_available=te)

    assert kwargs(False)["cp_comm_type"] == "all_gather"  # auto: all-to-all was not measured on CPU
    assert kwargs(False, "parallel.cp_comm_type=a2a")["cp_comm_type"] == "a2a"
    on_gpus = ("cluster=h100_x2", "model=bench_1b")  # auto: all-to-all, measured faster at CP=2
    assert kwargs(False, *on_gpus)["cp_comm_type"] == kwargs(True, *on_gpus)["cp_comm_type"] == "a2a"
    assert kwargs(False, *on_gpus, "data.packing=true")["cp_comm_type"] == "all_gather"
    assert "cp_comm_type" not in kwargs(True)
    assert kwargs(True, "parallel.cp_comm_type=a2a")["cp_comm_type"] == "a2a"


def test_recompute_and_moe_map_to_transformer_config(compose):
    from megatron.core.transformer import TransformerConfig

    from gridwright.engines.megatron_model import transformer_config_kwargs
    from gridwright.planning.layout import ParallelLayout

    cfg = compose("+experiment=mixtral_ep8")
    tc = TransformerConfig(**transformer_config_kwargs(cfg, ParallelLayout.from_config(cfg), te_available=False))
    assert tc.num_moe_experts == 8 and tc.moe_router_topk == 2 and tc.expert_model_parallel_size == 8
    assert tc.recompute_granularity == "full" and tc.recompute_method == "uniform"
