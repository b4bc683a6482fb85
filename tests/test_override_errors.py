"""Mistakes on the command line that Hydra finds (a misspelt key, an unknown group option or
preset, a value of the wrong type, an override that does not parse) are one `error: ` line
and exit code 2, as `python launch.py` and the `gridwright` command print them."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, launch

EXIT_INVALID = 2


def options(group: str) -> str:
    return ", ".join(sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml")))


KEY = "error: train.stpes is not a key of the experiment's schema (gridwright.config.schema). Did you mean train.steps?"
CASES = [
    (["train.stpes=5"], KEY),
    (["+train.stpes=5"], KEY),
    (["+experiment=tiny_llama_tp3"],
     f"error: no experiment preset 'tiny_llama_tp3'. Did you mean tiny_llama_tp2? Choices: {options('experiment')}"),
    (["+experiment=nosuch"], f"error: no experiment preset 'nosuch'. Choices: {options('experiment')}"),
    (["cluster=nosuch"], f"error: no cluster option 'nosuch'. Choices: {options('cluster')}"),
    (["engine=megatorn"], "error: no engine option 'megatorn'. Did you mean megatron? Choices: deepspeed, megatron"),
    (["zero=stage9"], f"error: no zero option 'stage9'. Did you mean stage3? Choices: {options('zero')}"),
    # A precision is offered only where it validates on this machine: mxfp8 (Blackwell) was
    # offered for `fp8` on a CPU; fp8_rowwise runs here (torchao, emulated)
    (["precision=fp8"], f"error: no precision option 'fp8'. Did you mean fp8_rowwise? Choices: {options('precision')}"),
    (["precision=mxfp"], f"error: no precision option 'mxfp'. Choices: {options('precision')}"),
    (["parallel.tp=abc"], "error: parallel.tp must be an integer, not 'abc'."),
    (["train.steps=1.5"], "error: train.steps must be an integer, not '1.5'."),
    (["train.steps=[1,"], "error: cannot parse 'train.steps=[1,': no viable alternative at input '[1,'. "
                          "train.steps takes an integer. Override syntax: "
                          "https://hydra.cc/docs/advanced/override_grammar/basic/"),
    (["parallel.tp=1,2"], "error: parallel.tp=1,2 gives several values: add -m (--multirun) to run one job for "
                          "each, or write a list value as parallel.tp=[...]."),
    # A sweep is refused whole, before any point starts, when one of its values is a mistake.
    (["-m", "parallel.tp=1,abc"], "error: parallel.tp must be an integer, not 'abc'."),
    (["-m", "+experiment=tiny_llama_cpu,tiny_lama_tp2"],
     f"error: no experiment preset 'tiny_lama_tp2'. Did you mean tiny_llama_tp2? Choices: {options('experiment')}"),
]


def the_one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == EXIT_INVALID, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("args, expected", CASES, ids=[" ".join(args) for args, _ in CASES])
def test_a_command_line_mistake_is_one_line(tmp_path, args, expected):
    result = launch([*args, "launcher=plan", f"job_root={tmp_path / 'jobs'}"], cwd=tmp_path)
    line = the_one_line(result)
    assert line == expected
    assert "+train.stpes" not in line  # Hydra's advice: append the typo
    assert not (tmp_path / "jobs").exists()


def test_the_gridwright_command_says_the_same(tmp_path):
    command = shutil.which("gridwright", path=str(Path(sys.executable).parent))
    assert command, "the console script `gridwright` is installed beside this Python"
    result = subprocess.run([command, "engine=megatorn", "launcher=plan", f"job_root={tmp_path / 'jobs'}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert the_one_line(result) == "error: no engine option 'megatorn'. Did you mean megatron? Choices: deepspeed, megatron"


@pytest.mark.parametrize("args", [["launcher=plan"], ["--cfg", "job", "train.steps=3", "hydra/job_logging=default"]])
def test_valid_overrides_still_run(tmp_path, args):
    result = launch([*args, f"job_root={tmp_path / 'jobs'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "error" not in result.stderr
