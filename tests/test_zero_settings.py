"""DeepSpeed's ZeRO settings (conf/zero): derived values, the JSON DeepSpeed reads, problems."""
import subprocess
import sys

import pytest

from gridwright.engines.deepspeed_config import deepspeed_config
from gridwright.engine_rules.zero_settings import (GRIDWRIGHT_KEYS, explicit_deepspeed_only_keys,
                                              resolved_zero_settings, zero_settings_problems)
from gridwright.planning.layout import ParallelLayout

DS = ["engine=deepspeed"]
GPU8_8B = DS + ["model=llama3_8b", "cluster=dgx_h100", "precision=bf16", "train.micro_batch_size=1",
                "train.global_batch_size=64", "train.seq_length=4096"]


def _resolved(compose, *overrides):
    cfg = compose(*overrides)
    return resolved_zero_settings(cfg.zero, cfg.cluster)


def test_bench_model_zero3_gets_deepspeeds_documented_defaults(compose):
    """bench_1b on one H100: DeepSpeed's defaults, measured faster there than the Hugging
    Face integration's sizes from hidden_size (zero_settings says by how much)."""
    assert _resolved(compose, "+bench=bench_gpu", *DS, "zero=stage3") == {
        "overlap_comm": True,  # CUDA
        "contiguous_gradients": True,
        "reduce_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_leaf_layers": True,  # gridwright's: whole decoder layers fetched at once
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False,
    }


def test_llama3_8b_values_per_stage(compose):
    assert _resolved(compose, *GPU8_8B, "zero=stage2") == {
        "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000}
    z3 = _resolved(compose, *GPU8_8B, "zero=stage3")
    assert (z3["reduce_bucket_size"], z3["stage3_prefetch_bucket_size"], z3["stage3_param_persistence_threshold"]) \
        == (500_000_000, 50_000_000, 100_000)
    assert "allgather_bucket_size" not in z3  # ZeRO-3 does not read it


def test_cpu_and_stage0_defaults(compose):
    z = _resolved(compose, *DS, "zero=stage1")  # tiny_llama on the laptop cluster
    assert z["overlap_comm"] is False and z["reduce_bucket_size"] == 500_000_000
    assert _resolved(compose, *DS, "zero=stage0") == {}  # ZeRO-0 reads none of them


def test_every_zero_option_composes_without_problems(compose):
    for option in ("stage0", "stage1", "stage2", "stage2_offload", "stage3", "stage3_offload"):
        cfg = compose(*DS, f"zero={option}")
        assert explicit_deepspeed_only_keys(cfg.zero) == []
        assert zero_settings_problems(cfg.zero, cfg.cluster, ParallelLayout.from_config(cfg)) == [], option


def test_override_reaches_the_deepspeed_json(compose):
    cfg = compose(*DS, "zero=stage2", "zero.reduce_bucket_size=12345", "zero.overlap_comm=true")
    zero = deepspeed_config(cfg, ParallelLayout.from_config(cfg))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 12345 and zero["overlap_comm"] is True
    assert zero["allgather_bucket_size"] == 500_000_000 and zero["stage"] == 2
    assert not {"zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"} & set(zero)


def test_zeropp_keys_only_when_on(compose):
    off = compose(*GPU8_8B, "zero=stage3")
    assert "zero_hpz_partition_size" not in deepspeed_config(off, ParallelLayout.from_config(off))["zero_optimization"]
    on = compose(*GPU8_8B, "zero=stage3", "cluster.nodes=2", "zero.zero_hpz_partition_size=8",
                 "zero.zero_quantized_weights=true", "zero.zero_quantized_gradients=true")
    zero = deepspeed_config(on, ParallelLayout.from_config(on))["zero_optimization"]
    assert (zero["zero_hpz_partition_size"], zero["zero_quantized_weights"], zero["zero_quantized_gradients"]) == (8, True, True)
    assert zero_settings_problems(on.zero, on.cluster, ParallelLayout.from_config(on)) == []


# DeepSpeed's pydantic model forbids unknown keys, so a misspelt key name fails here; the
# values are read back through its field names (stage3_* keys are aliases).
DEEPSPEED_CASES = [
    DS + ["zero=stage1"],
    DS + ["zero=stage2", "zero.reduce_bucket_size=12345"],
    DS + ["zero=stage2_offload"],
    DS + ["zero=stage3", "zero.stage3_max_live_parameters=0"],
    DS + ["zero=stage3_offload"],
    GPU8_8B + ["zero=stage3", "cluster.nodes=2", "zero.zero_hpz_partition_size=8", "zero.zero_quantized_weights=true",
               "zero.zero_quantized_gradients=true"],
]


@pytest.mark.parametrize("overrides", DEEPSPEED_CASES, ids=lambda o: " ".join(o[1:]))
def test_json_is_accepted_by_deepspeeds_zero_config(compose, overrides):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = compose(*overrides)
    zero = deepspeed_config(cfg, ParallelLayout.from_config(cfg))["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)
    by_alias = parsed.model_dump(by_alias=True)
    for key, value in resolved_zero_settings(cfg.zero, cfg.cluster).items():
        if key not in GRIDWRIGHT_KEYS:  # those the engine applies itself
            assert by_alias[key] == value, key
    assert int(parsed.stage) == cfg.zero.stage


def test_whole_json_is_accepted_by_deepspeeds_config_parser(compose):
    """DeepSpeedConfig checks the batch arithmetic too, against a world of 1 without torch.distributed."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = compose("+bench=bench_gpu", *DS, "zero=stage3", "zero.reduce_bucket_size=12345")
    parsed = DeepSpeedConfig(deepspeed_config(cfg, ParallelLayout.from_config(cfg)))
    z = parsed.zero_config
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (12345, 50_000_000, 100_000)
    assert z.overlap_comm is True and z.contiguous_gradients is True


PROBLEMS = {
    # name: (overrides, substrings of one problem line)
    "reduce_bucket_zero": (DS + ["zero=stage2", "zero.reduce_bucket_size=0"],
                           ["zero.reduce_bucket_size=0 must be a positive number of elements", "derived: 5e8"]),
    "allgather_bucket_negative": (DS + ["zero=stage1", "zero.allgather_bucket_size=-2"],
                                  ["zero.allgather_bucket_size=-2 must be a positive number"]),
    "prefetch_negative": (DS + ["zero=stage3", "zero.stage3_prefetch_bucket_size=-1"],
                          ["zero.stage3_prefetch_bucket_size=-1 must be 0 or more", "derived: 5e7"]),
    "persistence_negative": (DS + ["zero=stage3", "zero.stage3_param_persistence_threshold=-5"],
                             ["zero.stage3_param_persistence_threshold=-5 must be 0 or more"]),
    "hpz_zero": (DS + ["zero=stage3", "zero.zero_hpz_partition_size=0"],
                 ["zero.zero_hpz_partition_size=0 must be 1 or more"]),
    "keys_on_stage0": (DS + ["zero=stage0", "zero.overlap_comm=true", "zero.reduce_bucket_size=1000"],
                       ["zero.overlap_comm=true, zero.reduce_bucket_size=1000 with zero.stage=0",
                        "ZeRO-0 runs no ZeRO optimizer"]),
    "stage3_key_on_stage2": (DS + ["zero=stage2", "zero.stage3_max_live_parameters=100"],
                             ["zero.stage3_max_live_parameters=100 with zero.stage=2", "ZeRO-3's",
                              "Fix: remove them, or zero.stage=3"]),
    "hpz_on_stage1": (DS + ["zero=stage1", "zero.zero_hpz_partition_size=2"],
                      ["zero.zero_hpz_partition_size=2 with zero.stage=1", "ZeRO++"]),
    "qwz_on_stage2": (DS + ["zero=stage2", "zero.zero_quantized_weights=true"],
                      ["zero.zero_quantized_weights=true with zero.stage=2", "never reads these keys"]),
    "odd_allgather_bucket": (DS + ["zero=stage2", "zero.allgather_bucket_size=1001"],
                             ["zero.allgather_bucket_size=1001 must be even", "nccl_start_alignment_factor"]),
    "uncontiguous_offload": (DS + ["zero=stage2_offload", "zero.contiguous_gradients=false"],
                             ["zero.contiguous_gradients=false with zero.offload_optimizer=true"]),
    "allgather_on_stage3": (DS + ["zero=stage3", "zero.allgather_bucket_size=1000"],
                            ["zero.allgather_bucket_size=1000 with zero.stage=3", "does not use it"]),
    "hpz_not_dividing_dp": (GPU8_8B + ["zero=stage3", "zero.zero_hpz_partition_size=3"],
                            ["zero.zero_hpz_partition_size=3 does not divide the data-parallel size 8",
                             "cluster.gpus_per_node=8"]),
    "qwz_on_cpu": (DS + ["zero=stage3", "zero.zero_quantized_weights=true"],
                   ["zero.zero_quantized_weights=true on cluster.device=cpu", "CUDA quantizer kernels"]),
    "qgz_on_cpu": (DS + ["zero=stage3", "zero.zero_quantized_gradients=true"],
                   ["zero.zero_quantized_gradients=true on cluster.device=cpu"]),
    "qgz_on_one_node": (GPU8_8B + ["zero=stage3", "zero.zero_quantized_gradients=true"],
                        ["zero.zero_quantized_gradients=true on cluster.nodes=1", "falls back"]),
}


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_each_problem_has_its_line(compose, name):
    overrides, expected = PROBLEMS[name]
    cfg = compose(*overrides)
    problems = zero_settings_problems(cfg.zero, cfg.cluster, ParallelLayout.from_config(cfg))
    assert len(problems) == 1, problems
    for text in expected:
        assert text in problems[0], f"{text!r} not in:\n{problems[0]}"


def test_explicit_deepspeed_only_keys(compose):
    assert explicit_deepspeed_only_keys(compose("zero=stage1").zero) == []
    cfg = compose("zero=stage1", "zero.overlap_comm=false", "zero.reduce_bucket_size=5000",
                  "zero.zero_quantized_weights=false", "zero.zero_hpz_partition_size=1")
    # ZeRO++ keys at their off values ask for nothing
    assert explicit_deepspeed_only_keys(cfg.zero) == ["overlap_comm", "reduce_bucket_size"]
    cfg = compose("zero=stage3", "zero.stage3_prefetch_bucket_size=0", "zero.zero_quantized_gradients=true")
    assert explicit_deepspeed_only_keys(cfg.zero) == ["stage3_prefetch_bucket_size", "zero_quantized_gradients"]


def test_plan_records_the_settings(compose):
    from gridwright.validation.validate import validate

    cfg = compose(*DS, "zero=stage2", "zero.reduce_bucket_size=12345")
    record = validate(cfg, for_launch=False).record()
    assert record["zero_settings"] == resolved_zero_settings(cfg.zero, cfg.cluster)
    assert record["zero_settings"]["reduce_bucket_size"] == 12345
    assert validate(compose("zero=stage1"), for_launch=False).record()["zero_settings"] is None  # engine=megatron


def test_sizes_are_integers_in_conf(compose):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose("zero.reduce_bucket_size=5e8")


def test_module_imports_neither_torch_nor_deepspeed():
    code = ("import sys, gridwright.engine_rules.zero_settings; "
            "print(','.join(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_validation_refuses_through_each_engines_rules(compose):
    """engine=deepspeed reports zero_settings_problems; engine=megatron refuses every
    DeepSpeed-only key it was given."""
    from gridwright.validation.validate import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose(*DS, "zero=stage2", "zero.allgather_bucket_size=1001"), for_launch=False)
    assert "zero.allgather_bucket_size=1001 must be even" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate(compose("zero=stage1", "zero.reduce_bucket_size=5000"), for_launch=False)
    assert "zero.reduce_bucket_size" in str(err.value) and "engine=megatron" in str(err.value)
