"""The torch fence: the two tested releases pass, another is refused in one line with exit 2
before anything starts (a local launch, a conversion) and by the workers of a job planned
elsewhere, and every private torch call gridwright makes resolves on the installed torch."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_torchrun_job

from gridwright.versions.torch_version import (
    OVERRIDE,
    PRIVATE_CALLS,
    UntestedTorch,
    refuse_untested,
    unresolved_private_calls,
    version_problem,
)


def test_every_private_call_resolves_on_the_installed_torch():
    assert len(PRIVATE_CALLS) >= 8
    assert unresolved_private_calls() == []


def private_name(path: str) -> str:
    """The private part of a path: its last component with a leading underscore."""
    return [part for part in path.split(".") if part.startswith("_")][-1]


def private_torch_uses(text: str) -> set[str]:
    """The private torch paths of PRIVATE_CALLS that a module's code names."""
    return {path for path, _ in PRIVATE_CALLS if re.search(rf"\b{private_name(path)}\b", text)}


def test_each_private_call_is_made_where_the_fence_says():
    """The fence names the module of each private call: that module names it, and no module
    outside the upstream doors makes one the fence does not list there."""
    code = REPO / "toolkit"
    where = {path: why.split(":", 1)[0] for path, why in PRIVATE_CALLS}
    for path, module in where.items():
        text = (code / (module.replace(".", "/") + ".py")).read_text()
        assert private_name(path) in text, f"{module} does not call {path}, which the fence says it does"
    for file in code.rglob("*.py"):
        module = str(file.relative_to(code).with_suffix("")).replace("/", ".")
        if module.startswith(("versions.", "megatron_internals.", "deepspeed_internals.")):
            continue
        unlisted = {p for p in private_torch_uses(file.read_text()) if where[p] != module}
        assert not unlisted, f"{module} calls {sorted(unlisted)}, which the fence lists elsewhere"


def test_a_private_call_that_is_gone_is_named(monkeypatch):
    import torch

    monkeypatch.delattr(torch, "_scaled_mm")
    assert unresolved_private_calls() == ["torch._scaled_mm"]


def test_the_tested_releases_pass_with_their_local_builds_and_another_is_refused(monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    assert version_problem("2.13.0+cpu") is None and version_problem("2.11.0+cu130") is None
    problem = version_problem("2.12.0+cu128")
    assert problem == ("torch 2.12.0+cu128 is installed; gridwright is tested with torch==2.13.0 or torch==2.11.0 "
                       "only (the private calls listed in gridwright.versions.torch_version are those releases'). "
                       f"Fix: pip install torch==2.13.0, or set {OVERRIDE}=1 to try anyway.")
    assert "\n" not in problem
    with pytest.raises(UntestedTorch):
        refuse_untested("2.12.0")
    monkeypatch.setenv(OVERRIDE, "1")
    refuse_untested("2.12.0")  # warns and goes on


def fake_torch_release(tmp: Path, version: str) -> Path:
    """A folder whose dist-info makes the installed torch report `version` to its metadata
    readers (the torch package itself still imports from site-packages)."""
    info = tmp / "fake_torch" / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return info.parent


@pytest.mark.slow
def test_an_untested_torch_is_refused_before_start_and_by_the_workers(tmp_path, monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(fake_torch_release(tmp_path, "2.99.0")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    line = "torch 2.99.0 is installed; gridwright is tested with torch==2.13.0 or torch==2.11.0 only"
    launched = subprocess.run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_dir={tmp_path / 'job'}"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 2 and launched.stderr.count(line) == 1, launched.stderr[-2000:]
    assert not (tmp_path / "job").exists()
    converted = subprocess.run([sys.executable, "-m", "gridwright.adapters.convert", "hf-to-megatron", "--hf",
                                str(tmp_path), "--out", str(tmp_path / "out")], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)
    assert converted.returncode == 2 and converted.stderr.startswith(f"error: {line}"), converted.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    # A torchrun job planned on a tested machine, run on a node with another torch
    result = run_torchrun_job(tmp_path, "train.steps=2")
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"UntestedTorch: {line}" in result.stderr, result.stderr[-3000:]
    assert "step     0" not in result.stdout
