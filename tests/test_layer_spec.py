"""Whose layers a run builds (engine.layer_spec) and what each machine refuses: the rules a
worker applies at start, checked here as if Transformer Engine imported (te_imports=True)
or did not, since TE cannot import on a CPU machine."""
from __future__ import annotations

import pytest

from gridwright.config.fp8_choice import fp8_backend, transformer_engine_layers
from gridwright.validation.validate import (
    LAYER_SPEC_WITHOUT_TE,
    fix_overrides,
    fp8_machine_problems,
    layer_spec_machine_problems,
)

GPU = ["model=bench_1b", "cluster=h100_x1", "zero=stage1", "train.seq_length=4096", "train.micro_batch_size=1",
       "train.global_batch_size=8", "launcher=plan"]


@pytest.mark.parametrize("overrides, te_imports, te_layers", [
    ([], True, True),
    ([], False, False),
    (["engine.layer_spec=torch_native"], True, False),
    (["engine.layer_spec=transformer_engine"], True, True),
    (["engine.compile_layers=true"], True, False),  # only the torch-native spec compiles
    (["precision=fp8_tensorwise", "precision.fp8_backend=torchao"], True, False),
    (["precision=fp8_tensorwise", "precision.fp8_output_layer=true", "model=llama3_8b"], True, True),  # either spec runs it
    (["precision=fp8_rowwise"], True, False),
    (["precision=fp8_tensorwise"], True, False),  # the bench model's hidden 2048: torchao measured faster
    (["precision=fp8_tensorwise", "model=llama3_8b"], True, True),  # 4096: TE's current scaling measured faster
    (["precision=fp8_tensorwise", "precision.fp8_backend=transformer_engine"], True, True),
    (["precision=fp8_delayed"], True, True),  # TE's recipe: TE's layers at any size
])
def test_auto_builds_te_where_it_imports_unless_a_torch_native_key_is_set(compose, overrides, te_imports, te_layers):
    cfg = compose(*GPU, *overrides)
    assert transformer_engine_layers(cfg.engine, cfg.precision, cfg.model, te_imports) is te_layers


def test_fp8_backend_follows_the_layers(compose):
    cfg = compose(*GPU, "precision=fp8_tensorwise")
    assert fp8_backend(cfg.precision, True) == "transformer_engine"
    assert fp8_backend(cfg.precision, False) == "torchao"


def test_a_te_recipe_with_a_torch_native_key_names_the_key_and_its_fix_clears_it(compose):
    cfg = compose(*GPU, "precision=fp8_delayed", "engine.compile_layers=true")
    problems = fp8_machine_problems(cfg, te_imports=True)
    assert problems == ["precision.fp8_recipe=delayed is Transformer Engine's, but this run builds the torch-native "
                        "layer spec (engine.compile_layers=true asks for the torch-native spec). "
                        "Fix: engine.compile_layers=false."]
    fixed = compose(*GPU, "precision=fp8_delayed", *fix_overrides(problems[0]))
    assert fp8_machine_problems(fixed, te_imports=True) == []
    torchao = compose(*GPU, "precision=fp8_delayed", "precision.fp8_backend=torchao")
    assert fp8_machine_problems(torchao, te_imports=True)[0].endswith("Fix: precision.fp8_backend=auto.")
    explicit = compose(*GPU, "precision=fp8_delayed", "engine.layer_spec=torch_native")
    assert "Fix: engine.layer_spec=auto." in fp8_machine_problems(explicit, te_imports=True)[0]


def test_torchao_under_te_layers_is_refused_and_auto_takes_the_torch_native_spec(compose):
    cfg = compose(*GPU, "precision=fp8_tensorwise", "precision.fp8_backend=torchao",
                  "engine.layer_spec=transformer_engine")
    assert "Fix: engine.layer_spec=auto." in fp8_machine_problems(cfg, te_imports=True)[0]
    assert fp8_machine_problems(compose(*GPU, "precision=fp8_tensorwise", "precision.fp8_backend=torchao"),
                                te_imports=True) == []


def test_te_layers_where_te_does_not_import_are_refused_by_the_worker(compose):
    cfg = compose(*GPU, "engine.layer_spec=transformer_engine")
    assert layer_spec_machine_problems(cfg.engine, cfg.parallel, te_imports=False) == [LAYER_SPEC_WITHOUT_TE]
    assert layer_spec_machine_problems(cfg.engine, cfg.parallel, te_imports=True) == []
    auto = compose(*GPU)
    assert layer_spec_machine_problems(auto.engine, auto.parallel, te_imports=False) == []


def test_the_float8_output_layer_runs_beside_te_fp8_as_torchao_tensorwise(compose):
    """TE's layers take the recipe; the output layer (outside every spec) runs torchao's
    tensorwise matmul with the same weight, so a TE recipe with it validates and the
    TransformerConfig routes only the output layer."""
    from megatron.core.transformer import TransformerConfig

    from gridwright.validation.validate import validate
    from gridwright.engines.megatron_model import choose_torch_native_paths

    for recipe in ("fp8_delayed", "fp8_tensorwise", "fp8_blockwise"):
        cfg = compose(*GPU, f"precision={recipe}", "precision.fp8_output_layer=true")
        validate(cfg)  # raises ConfigError on any problem
        assert fp8_machine_problems(cfg, te_imports=True) == []
        tcfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        choose_torch_native_paths(cfg, tcfg, te_available=True)
        assert tcfg.gridwright_float8_output_layer and tcfg.gridwright_float8_name == "float8_tensorwise(torchao)"
        assert tcfg.gridwright_float8[0].cast_config_weight.scaling_granularity.name == "TENSORWISE"
    off = compose(*GPU, "precision=fp8_delayed", "precision.fp8_output_layer=false")
    tcfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    choose_torch_native_paths(off, tcfg, te_available=True)
    assert tcfg.gridwright_float8 is None and not tcfg.gridwright_float8_output_layer
    # left to auto: on for delayed scaling on one GPU per replica (measured faster), off under TP
    for overrides, on in (([], True), (["parallel.tp=2"], False), (["precision=fp8_blockwise"], False)):
        tcfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        choose_torch_native_paths(compose(*GPU, "precision=fp8_delayed", *overrides), tcfg, te_available=True)
        assert tcfg.gridwright_float8_output_layer == on, overrides


@pytest.mark.parametrize("overrides, on_cuda, te_installed, words", [
    ([], False, True, "torch_native (Transformer Engine runs only on CUDA)"),
    ([], True, False, "torch_native (engine.layer_spec=auto, Transformer Engine not installed here)"),
    (["precision=fp8_delayed", "precision.fp8_output_layer=true"], True, True,
     "transformer_engine (engine.layer_spec=auto, Transformer Engine installed here); FP8 delayed by "
     "transformer_engine, output layer by torchao (tensorwise)"),
    (["precision=fp8_tensorwise", "engine.compile_layers=true"], True, True,
     "torch_native (engine.compile_layers=true asks for it); FP8 tensorwise by torchao, output layer too "
     "(precision.fp8_output_layer=auto: measured faster on one GPU per model replica)"),
    (["precision=fp8_tensorwise"], True, True,
     "torch_native (engine.layer_spec=auto: at hidden size 2048 torchao's FP8 was measured faster than Transformer "
     "Engine's, which was measured faster from 4096); FP8 tensorwise by torchao, output layer too "
     "(precision.fp8_output_layer=auto: measured faster on one GPU per model replica)"),
    (["precision=fp8_tensorwise", "precision.fp8_output_layer=false"], True, True,
     "torch_native (engine.layer_spec=auto: at hidden size 2048 torchao's FP8 was measured faster than Transformer "
     "Engine's, which was measured faster from 4096); FP8 tensorwise by torchao"),
    (["precision=fp8_delayed"], True, True,
     "transformer_engine (engine.layer_spec=auto, Transformer Engine installed here); FP8 delayed by "
     "transformer_engine, output layer by torchao (tensorwise) (precision.fp8_output_layer=auto: measured faster "
     "on one GPU per model replica)"),
    (["precision=fp8_delayed", "parallel.tp=2"], True, True,  # with model parallelism it was not measured
     "transformer_engine (engine.layer_spec=auto, Transformer Engine installed here); FP8 delayed by "
     "transformer_engine"),
    (["precision=fp8_tensorwise", "model=llama3_8b"], True, True,
     "transformer_engine (engine.layer_spec=auto, Transformer Engine installed here); FP8 tensorwise by "
     "transformer_engine"),
    (["precision=fp8_delayed"], True, False,
     "torch_native (engine.layer_spec=auto, Transformer Engine not installed here); FP8 delayed needs "
     "Transformer Engine's layers (refused where they are not built)"),
    (["engine.layer_spec=transformer_engine", "precision=fp8_delayed"], True, False,
     "transformer_engine (engine.layer_spec=transformer_engine; not installed on this host: each worker checks "
     "its node); FP8 delayed by transformer_engine, output layer by torchao (tensorwise) "
     "(precision.fp8_output_layer=auto: measured faster on one GPU per model replica)"),
])
def test_the_plan_names_whose_layers_and_fp8_a_run_gets(compose, overrides, on_cuda, te_installed, words):
    from gridwright.config.fp8_choice import planned_layers

    cfg = compose(*GPU, *overrides)
    assert planned_layers(cfg.engine, cfg.precision, cfg.model, cfg.parallel, on_cuda, te_installed) == words


def test_the_printed_plan_has_its_layers_line(run_launch):
    result = run_launch("launcher=plan")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\nlayers      torch_native (Transformer Engine runs only on CUDA)\n" in result.stdout
