"""The terminal says only what gridwright says: upstream noise is filtered (each filter with
its reason, gridwright.basics.known_warnings), long waits print what they do with an
estimate, and a resume that changes the learning-rate schedule says so.

The slow tests run the documented commands (the quick start, a DeepSpeed run, a
conversion with --verify, a profiled sweep) and check every line of their output against
gridwright's own vocabulary, and against the upstream lines that used to get through."""
from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

# Lines that reached the terminal before their filters, and the generic marks of upstream output.
UPSTREAM_NOISE = (
    r"\[transformers\]",  # transformers' own logging prefix (the rope warning, use_cache)
    r"original_max_position_embeddings field must be less",
    r"built successfully",  # DeepSpeed's op builder
    r"is_gradient_checkpointing|gradient_checkpointing_enable",
    r"^USDT:|profiler_(start|stop)",  # libkineto
    r"fontManager",  # matplotlib under Hydra's logging
    r"\[HYDRA\]",  # Hydra's own log lines (its launcher's per-point lines: gridwright prints `point`)
    r"Warning|warn\(",  # any Python warning and the source line printed under it
    r"^\[W",  # torch's C++ warnings ([W1128 ...])
    r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING)\]",  # DeepSpeed's logger
    r"it/s\]|\d+%\|",  # progress bars (tqdm)
)

# gridwright's own lines: a label in the 12-column margin, indented continuations and tables.
VOCABULARY = (
    r"^(experiment|model|cluster|layout|batch|layers|saves|predicted|advise|job dir|sweep dir|sweep|point|summary|mlflow|"
    r"checkpoint|resume|deepspeed)"
    r" +\S",
    r"^FLOPs/token \S",
    r"^placement$",
    r"^step +\d+ loss \d",
    r"^ +\S",  # under a label: placement and sweep tables, summary lines
    r"^\+ \S*python\S* -m gridwright\.launchers\.agent --job-dir ",  # the command a local launch runs
    r"^communication: ",
    r"^done: ",
    r"^verify: ",
    r"^wrote \S+: \d+ Hugging Face tensors in ",
    r"^train from it: python launch\.py ",
    r"^$",
)


def foreign_lines(output: str) -> list[str]:
    """Lines of `output` that are upstream noise or not in gridwright's vocabulary."""
    return [line for line in output.splitlines()
            if any(re.search(p, line) for p in UPSTREAM_NOISE) or not any(re.search(p, line) for p in VOCABULARY)]


def run(args: list[str], cwd, timeout: int = 420, **env) -> subprocess.CompletedProcess:
    """A command as a user types it, stdout and stderr as they interleave on a terminal."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=dict(environ, **env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc


def launch_args(tmp_path, *overrides, sweep: bool = False) -> list[str]:
    """`launch.py` with its jobs and MLflow store under `tmp_path` (`sweep`: Hydra's -m)."""
    return [str(REPO / "launch.py"), *(["-m"] if sweep else []), f"job_root={tmp_path / 'jobs'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *overrides]


def test_the_vocabulary_tells_gridwright_lines_from_upstream_ones():
    ours = """experiment  tiny_llama   engine megatron   launcher local
FLOPs/token 1.30 M (megatron: causal attention halved)
layers      torch_native (Transformer Engine runs only on CUDA)
placement
  rank  host  gpu  tp  cp   dp  pp  ep etp  edp  tp group / ep group
step     0 loss 5.5500 lr 0.00e+00 53 ms 4846 tok/s/gpu
checkpoint  saved /tmp/ck/iter_0000010 in 0.5 s (2.7 MiB)
resume      train.steps 10 -> 20 changes the LR schedule: lr at step 10 was 1.0e-03, is now 6.3e-03
point       #0: parallel.tp=1"""
    assert foreign_lines(ours) == []
    theirs = [
        "[transformers] `rope_parameters`'s original_max_position_embeddings field must be less than "
        "max_position_embeddings, got 8192 and max_position_embeddings=256",
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
        "/site-packages/transformers/modeling_utils.py:3312: FutureWarning: `is_gradient_checkpointing` is deprecated",
        "  warnings.warn(",
        "USDT:2026-11-28 06:27:15 13654:13654 SyncActivityProfilerHandler.cpp:52] profiler_start",
        "[2026-11-28 06:27:06,231][HYDRA] generated new fontManager",
        "[2026-11-28 06:27:06,231][HYDRA] Launching 2 jobs locally",
        "Loading weights: 100%|██████████| 39/39 [00:00<00:00, 9184.09it/s]",
    ]
    assert foreign_lines("\n".join(theirs)) == theirs


# --- the filters, one by one -------------------------------------------------------------


def test_deepspeed_build_line_is_dropped_and_every_other_print_passes(capsys):
    from gridwright.basics.known_warnings import printed_lines_filtered

    with printed_lines_filtered():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("rank 0 says", "something", end="")
        print(" else")
    assert capsys.readouterr().out == "rank 0 says something else\n"


def test_kineto_usdt_lines_are_dropped_and_its_other_lines_kept(capfd):
    from gridwright.basics.known_warnings import native_stderr_filtered

    with native_stderr_filtered():
        os.write(2, b"USDT:2026-11-28 06:27:15 13654:13654 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:2026-11-28 06:27:15 13654:13654 CuptiActivityApi.cpp:1] CUPTI_ERROR_NOT_INITIALIZED\n")
        os.write(2, b"USDT:2026-11-28 06:27:16 13654:13654 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == \
        "ERROR:2026-11-28 06:27:15 13654:13654 CuptiActivityApi.cpp:1] CUPTI_ERROR_NOT_INITIALIZED\n"


def test_the_rope_check_of_a_model_with_fewer_positions_is_dropped_and_other_rope_warnings_kept():
    import gridwright  # noqa: F401 - installs the filters

    logger = logging.getLogger("transformers.modeling_rope_utils")
    seen = [logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, (), None))
            for message in ("`rope_parameters`'s original_max_position_embeddings field must be less than "
                            "max_position_embeddings, got 8192 and max_position_embeddings=256",
                            "`rope_parameters`'s factor field must be a float or int >= 1, got 0.5")]
    assert [bool(s) for s in seen] == [False, True]


def test_matplotlib_keeps_its_warnings_but_not_its_font_cache_notice():
    import gridwright  # noqa: F401

    fonts = logging.getLogger("matplotlib.font_manager")
    assert not fonts.isEnabledFor(logging.INFO) and fonts.isEnabledFor(logging.WARNING)


def test_the_checkpointing_rename_warning_is_ignored_and_other_future_warnings_are_not():
    import warnings

    import gridwright  # noqa: F401

    with warnings.catch_warnings(record=True) as caught:
        gridwright.filter_known_warnings()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                      "`is_activation_checkpointing` instead.", FutureWarning)
        warnings.warn("`something_else` is deprecated and will be removed in v6.", FutureWarning)
    assert [str(w.message) for w in caught] == ["`something_else` is deprecated and will be removed in v6."]


# --- progress and estimates ------------------------------------------------------------


def test_the_verify_estimate_counts_process_starts_per_core_the_load_and_the_measured_side():
    from gridwright.adapters.verify_logits import megatron_side_estimate_s

    # torchrun 2 s + 7 s per process start, 4 processes on 2 idle cores: two rounds; + the HF side's 3 s
    assert megatron_side_estimate_s(4, 3.0, cores=2) == pytest.approx(2 + 14 + 3)
    assert megatron_side_estimate_s(1, 3.0, cores=16) == pytest.approx(2 + 7 + 3)
    # two other runnable processes on the same 2 cores: the 4 start in 3 rounds' time
    assert megatron_side_estimate_s(4, 3.0, cores=2, busy=2.0) == pytest.approx(2 + 21 + 3)


def test_the_compile_estimate_is_the_measured_compiler_time_stretched_by_the_load():
    from gridwright.deepspeed_internals.extensions import compile_estimate_s

    assert compile_estimate_s(["deepspeed_shm_comm"], cores=2) == 75
    assert compile_estimate_s(["deepspeed_shm_comm", "cpu_adam"], cores=2) == 75 + 135
    assert compile_estimate_s(["deepspeed_shm_comm"], cores=2, busy=5.0) == 75 * 3  # a sixth of 2 cores each


def test_a_large_save_is_announced_with_its_size_and_then_an_estimate(compose, tmp_path, capsys):
    from gridwright.engines.training_loop import _SaveLines

    from gridwright.planning.disk_space import checkpoint_bytes

    cfg = compose("+experiment=llama3_8b", f"checkpoint.save={tmp_path}")
    saves = _SaveLines(cfg)
    saves.announce(100)
    # 8.0 B parameters x (bf16 weights 2 + fp32 masters 4 + Adam's moments 8 bytes) x 1.25
    assert capsys.readouterr().out == f"checkpoint  saving step 100 to {tmp_path}: about 130.9 GiB\n"
    saved = tmp_path / "iter_0000100"
    saved.mkdir()
    (saved / "shard").write_bytes(b"\0" * 3 * 1024**2)
    saves.done(saved, 2.0)  # 3 MiB in 2 s
    saves.announce(200)
    estimate = checkpoint_bytes(cfg.model, cfg.precision) / (1.5 * 1024**2)
    assert capsys.readouterr().out.splitlines() == [
        f"checkpoint  saved {saved} in 2.0 s (3.0 MiB)",
        f"checkpoint  saving step 200 to {tmp_path}: about 130.9 GiB, est. {estimate:.0f} s at the last save's rate"]


def test_a_changed_schedule_is_told_with_the_rate_before_and_after():
    import torch

    from gridwright.engines.optimizer_schedule import lr_scheduler, restore_schedule
    from omegaconf import OmegaConf

    def scheduler(steps):
        train = OmegaConf.create({"lr": 0.01, "min_lr": 0.001, "warmup_steps": 2, "steps": steps,
                                  "weight_decay": 0.1})
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        return lr_scheduler(train, opt)

    saved = scheduler(10)
    saved.step(increment=10)
    assert restore_schedule(scheduler(10), saved.state_dict(), 10) is None
    resumed = scheduler(20)
    line = restore_schedule(resumed, saved.state_dict(), 10)
    now = 0.001 + 0.009 * 0.5 * (math.cos(math.pi * (10 - 2) / (20 - 2)) + 1)  # cosine after a 2-step warm-up
    assert line == f"train.steps 10 -> 20 changes the LR schedule: lr at step 10 was 1.0e-03, is now {now:.1e}"
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(now)


# --- the documented commands, end to end ---------------------------------------------
# (The quick start and the README's profiled sweep are checked in test_mlflow_ui.py, which
# runs them for the browser anyway.)


@pytest.mark.slow
def test_deepspeed_run_with_recompute_evaluation_and_traces_prints_only_gridwright_lines(tmp_path):
    # docs/engines.md's CPU command (ZeRO-3, validation loss, traces), with recomputed layers
    out = run(launch_args(tmp_path, "engine=deepspeed", "zero=stage3", "train.recompute=full",
                          "data.eval_interval=2", "evaluate.profile_steps=[1,3]", "train.steps=4"), tmp_path).stdout
    assert "summary     4 steps: loss" in out
    assert foreign_lines(out) == []


@pytest.mark.slow
def test_conversion_with_verify_prints_its_stages_with_an_estimate_and_no_upstream_lines(tmp_path):
    made = run(["-m", "gridwright.adapters.tiny_models", "llama", "hf/tiny"], tmp_path).stdout
    assert made == "hf/tiny\n"  # no rope warning, no progress bar
    out = run(["-m", "gridwright.adapters.convert", "hf-to-megatron", "--hf", "hf/tiny", "--out", "ckpt/tiny",
               "--tp", "2", "--verify"], tmp_path).stdout
    lines = out.splitlines()
    assert re.fullmatch(r"verify: Hugging Face side \(1/2\): 0\.5 MiB of weights into transformers, forward on "
                        r"2 x 32 tokens \.\.\. \d+\.\d s", lines[0]), lines[0]
    assert re.fullmatch(r"verify: Megatron-Core side \(2/2\): 2 processes at TP=2 PP=1 EP=1 on \d+ CPU cores?, "
                        r"est\. \d+ s \.\.\. \d+\.\d s", lines[1]), lines[1]
    assert lines[2].startswith("verify: max |logit diff| ") and "(ok, tolerance 0.0001" in lines[2]
    assert foreign_lines(out) == []


@pytest.mark.slow
def test_resume_with_more_steps_says_the_schedule_changed(tmp_path):
    """DeepSpeed's resume (the Megatron engine's is checked in test_checkpoints, on a resume
    it runs anyway)."""
    ck = tmp_path / "ck"
    common = ["tracking=off", "engine=deepspeed", f"checkpoint.save={ck}"]
    first = run(launch_args(tmp_path, *common, "train.steps=4"), tmp_path).stdout
    assert "resume  " not in first
    out = run(launch_args(tmp_path, *common, "train.steps=9", f"checkpoint.load={ck}"), tmp_path).stdout
    # lr 1e-2 to min_lr 1e-3, 2 warm-up steps, cosine: at step 4 of 4 the floor; of 9, 2/7 into the decay
    now = 0.001 + 0.009 * 0.5 * (math.cos(math.pi * (4 - 2) / (9 - 2)) + 1)
    assert (f"resume      train.steps 4 -> 9 changes the LR schedule: lr at step 4 was 1.0e-03, "
            f"is now {now:.1e}") in out.splitlines()
    assert re.search(rf"^step +4 loss \S+ lr {now:.2e} ", out, re.M)  # the rate step 4 then trains with
    assert foreign_lines(out) == []


def test_a_first_compile_says_it_is_still_at_it(capsys):
    """DeepSpeed's op compile prints nothing for minutes: a line every interval says it goes on."""
    import time

    from gridwright.engines.deepspeed_engine import compile_progress

    with compile_progress(["deepspeed_shm_comm"], 75, every_s=0.2):
        time.sleep(0.7)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert all(re.fullmatch(r"deepspeed   still compiling deepspeed_shm_comm: \d+ s of est\. 75 s", x) for x in lines)
    assert foreign_lines("\n".join(lines)) == []
    with compile_progress([], 75, every_s=0.05):  # nothing to compile: silent
        time.sleep(0.2)
    assert capsys.readouterr().out == ""
