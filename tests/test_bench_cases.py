"""Every case of every bench_gpu suite is a valid experiment: a GPU call spent on a case
the validation refuses (a trace window past the last step, say) is device time lost."""
import pytest

from gridwright.validation.validate import ConfigError, validate
from gridwright.evaluations.bench_gpu import COMMON, SUITES, table

# What bench_gpu adds on the machine (device_overrides): the card the results were made on.
H200 = ["cluster.gpu.name=NVIDIA_H200", "cluster.gpu.memory_gib=139.8"]
# Cases kept to show the memory check's refusal: DP over every GPU cannot hold a 32k row of
# the Llama-3-8B shape, which is why the static layouts there need CP.
REFUSED_FOR_MEMORY = {"varlen_8b16l_dp4", "varlen2_8b16l_dp2"}


@pytest.mark.slow  # composes all 118 cases through Hydra: 30 s, a tenth of the fast tier
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


def test_fp8_loss_check_runs_validate_on_real_text_and_the_8b_shape(compose, tmp_path):
    """The command fp8_loss_check gives each precision, with --data (a prepared dataset),
    --model and --layers, is a valid experiment (bf16 and FP8 alike)."""
    import argparse
    import json

    from gridwright.data.prepare_data import prepare
    from gridwright.evaluations.fp8_loss_check import shape_and_data

    src = tmp_path / "text.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 3000}) + "\n" for i in range(40)))
    prepare([src], tmp_path / "text", "byte")
    extra = shape_and_data(argparse.Namespace(model="llama3_8b", layers=8, data=tmp_path / "text"))
    for precision in ("bf16", "fp8_tensorwise"):
        cfg = compose("+bench=bench_gpu", f"precision={precision}", "train.steps=300", "train.global_batch_size=8",
                      "engine.compile_layers=true", "cluster.gpu.name=NVIDIA_H200", *H200, *extra, "launcher=plan")
        validate(cfg)
        assert cfg.model.num_layers == 8 and cfg.model.hidden_size == 4096 and cfg.data.kind == "indexed"


def test_fp8_loss_check_compares_means_over_seeds_and_each_seed_with_its_bf16():
    """With several seeds, a precision's loss is the mean over its seeds, its difference from
    bf16 is the means', and each seed is also compared with bf16 of the same seed; a seed that
    failed leaves that precision's mean out rather than averaging fewer runs."""
    import argparse

    from gridwright.evaluations.fp8_loss_check import report

    def run(loss, tokens):
        return dict(loss10=loss, tokens=tokens, mfu=0.4, spec="local", losses=[loss + 1] * 5 + [loss] * 5)

    results = {("bf16", 1): run(2.0, 100.0), ("bf16", 2): run(1.0, 300.0),
               ("fp8_tensorwise", 1): run(2.2, 150.0), ("fp8_tensorwise", 2): run(0.9, 250.0),
               ("fp8_rowwise", 1): run(2.0, 100.0)}
    args = argparse.Namespace(seeds=[1, 2], runs_per_gpu=1, model=None, layers=None, data=None,
                              global_batch_size=8, lr=3e-4, steps=10, layer_spec="torch_native")
    text = report(["bf16", "fp8_tensorwise", "fp8_rowwise"], results, args, "H200", "2.11")
    assert "10 steps, compiled torch-native layers, seeds 1, 2" in text
    assert "| bf16 | local | 1.5000 | +0.00% | 2.0000 / 1.0000 | +0.00% / +0.00% | 200 | 1.00x | 40.0% |" in text
    assert "| fp8_tensorwise | local | 1.5500 | +3.33% | 2.2000 / 0.9000 | +10.00% / -10.00% | 200 | 1.00x |" in text
    assert "| fp8_rowwise | failed |" in text
    assert "| fp8_tensorwise | 2.550 | 2.550 | 2.550 | 2.550 | 2.550 | 1.550 |" in text  # curve: mean over seeds


def test_a_timed_out_command_leaves_no_process_behind():
    """run_bounded (bench_gpu's case timeout, the logits check's) stops the whole process
    tree before it returns: a launcher's workers would otherwise still hold the GPUs, and a
    grandchild holding the output pipe (here `sleep`) would keep the caller waiting."""
    import sys
    import time

    import psutil

    from gridwright.runtime.process_tree import run_bounded

    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
            "print(p.pid, flush=True); time.sleep(60)")
    started = time.monotonic()
    result = run_bounded([sys.executable, "-c", code], timeout=2)
    assert result.returncode == 124 and "timed out after 2 s" in result.stderr
    assert time.monotonic() - started < 30
    child = int(result.stdout.split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_an_interrupted_caller_leaves_no_process_behind():
    """A caller interrupted while it waits (the GPU tier's budget sends Ctrl-C; a test's
    timeout raises) ends the process tree it started: a launch's workers would otherwise go
    on holding the GPU while the next part of the tier runs."""
    import signal
    import sys
    import time

    import psutil

    from gridwright.runtime.process_tree import run_bounded

    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    old = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(2)  # KeyboardInterrupt in two seconds, inside run_bounded's wait
    try:
        with pytest.raises(KeyboardInterrupt):
            run_bounded([sys.executable, "-c", code], timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]


def test_the_wgrad_gemm_bench_refuses_a_machine_without_a_gpu():
    """One line and exit 2 where no GPU is visible, before any work."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "gridwright.evaluations.bench_wgrad_gemm"], capture_output=True,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: bench_wgrad_gemm measures CUDA GEMMs; no GPU is visible"]


def test_the_wgrad_gemm_table_gives_both_forms_of_each_precision():
    from gridwright.evaluations.bench_wgrad_gemm import table

    row = {"weight": "qkv [6144, 4096]", "bf16 ms": (0.6, 0.53), "bf16 error": (1.66e-3, 9.1e-6),
           "float8 ms": (0.37, 0.31), "float8 error": (1.66e-3, 1.04e-4)}
    assert table([row]).splitlines()[-1] == ("| qkv [6144, 4096] | 0.600 | 0.530 | 1.66e-03 / 9.10e-06 | 0.370 | 0.310 | "
                                            "1.66e-03 / 1.04e-04 |")


def test_fp8_loss_check_builds_te_layers_uncompiled_or_the_torch_native_spec_compiled():
    from gridwright.evaluations.fp8_loss_check import spec_overrides

    assert spec_overrides("transformer_engine") == ["engine.layer_spec=transformer_engine"]
    assert spec_overrides("torch_native") == ["engine.layer_spec=torch_native", "engine.compile_layers=true"]
