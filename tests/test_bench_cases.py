"""Every case of every bench_gpu suite is a valid experiment: a GPU call spent on a case
the validation refuses (a trace window past the last step, say) is device time lost."""
import pytest

from gridwright.config.validation import ConfigError, validate
from gridwright.evaluations.bench_gpu import COMMON, SUITES, table

# What bench_gpu adds on the machine (device_overrides): the card the results were made on.
H200 = ["cluster.gpu.name=NVIDIA_H200", "cluster.gpu.memory_gib=139.8"]
# Cases kept to show the memory check's refusal: DP over every GPU cannot hold a 32k row of
# the Llama-3-8B shape, which is why the static layouts there need CP.
REFUSED_FOR_MEMORY = {"varlen_8b16l_dp4", "varlen2_8b16l_dp2"}


def test_every_suite_case_validates(compose):
    for name, (gpus, overrides) in SUITES["all"].items():
        cfg = compose(*COMMON, *overrides, *H200, "launcher=plan")
        assert cfg.cluster.nodes * cfg.cluster.gpus_per_node == gpus, name
        if name in REFUSED_FOR_MEMORY:
            with pytest.raises(ConfigError, match="estimated memory per GPU"):
                validate(cfg)
        else:
            validate(cfg)  # raises ConfigError, naming the case's problem


def test_table_says_which_cases_timed_out():
    rows = [{"case": "a", "gpus": 2, "exit_code": 124}, {"case": "b", "gpus": 1, "exit_code": 1}]
    text = table(rows, "2 x NVIDIA H200")
    assert "| a | 2 | timed out |" in text and "| b | 1 | failed (exit 1) |" in text
