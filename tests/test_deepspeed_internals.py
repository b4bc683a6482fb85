"""The one door to DeepSpeed internals: its version fence, and each upstream line it stands on."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gridwright.versions import deepspeed_version
from gridwright.deepspeed_internals import checkpoint_files, engine_state, extensions, universal
from gridwright.versions.deepspeed_version import (
    OVERRIDE,
    TESTED,
    UntestedDeepSpeed,
    installed_version,
    refusal,
    refuse_untested,
    version_problem,
)

REPO = Path(__file__).resolve().parents[1]
MODULES = (universal, checkpoint_files, engine_state, extensions, deepspeed_version)
CITED = [(m.__name__.rsplit(".", 1)[1], path, text) for m in MODULES for path, text in m.CITED]


def upstream_file(path: str) -> Path:
    """`path` (package/file) in the installed package, found without importing it."""
    package, _, rest = path.partition("/")
    return Path(importlib.util.find_spec(package).submodule_search_locations[0]) / rest


@pytest.mark.parametrize("module,path,text", CITED)
def test_each_cited_upstream_line_is_still_there(module, path, text):
    """If an upgrade changes a line the fence stands on, this fails: look at the code in
    `module` again (a repair may be obsolete, a private name gone)."""
    assert text in upstream_file(path).read_text(), f"{path} no longer contains {text!r}: revisit {module}"


def test_each_allowlisted_class_is_a_cited_class():
    """The allowlist names classes by dotted path: each must be a class its cited file defines."""
    cited = {(path, text) for path, text in checkpoint_files.CITED}
    for dotted in checkpoint_files.PICKLED_CLASSES:
        module, name = dotted.rsplit(".", 1)
        path = module.replace(".", "/") + ".py"
        assert any(p == path and t.startswith(f"class {name}") for p, t in cited), dotted


# The DeepSpeed path's files outside the fence: none reaches into DeepSpeed or torch privately.
OUTSIDE = [*sorted((REPO / "toolkit" / "engines").glob("deepspeed_*.py")), REPO / "toolkit/engines/hf_model.py",
           REPO / "toolkit/checkpoints/checkpoint_trust.py", REPO / "adapters/deepspeed_files.py"]
PRIVATE = re.compile(r"^\s*(from|import) deepspeed\.|[\"']deepspeed\.\w|from torch[\w.]* import _\w|"
                     r"\.(skipped_steps|seq_data_parallel_group)\b|\.optimizer\.optimizer\b")


def test_the_deepspeed_path_reaches_deepspeed_internals_only_through_the_fence():
    found = [f"{f.relative_to(REPO)}:{i}: {line.strip()}" for f in OUTSIDE
             for i, line in enumerate(f.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert not found, "move into gridwright.deepspeed_internals:\n" + "\n".join(found)


def test_the_installed_deepspeed_is_the_tested_one(monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    assert installed_version() == TESTED
    assert version_problem() is None and refusal() is None
    refuse_untested()


def test_an_untested_version_is_refused_in_one_line_naming_both(monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    line = refusal("0.20.0")
    assert "\n" not in line
    assert line.startswith(f"DeepSpeed 0.20.0 is installed; gridwright is tested with deepspeed=={TESTED} only")
    assert f"Fix: pip install deepspeed=={TESTED}, or set {OVERRIDE}=1" in line
    with pytest.raises(UntestedDeepSpeed, match="0.20.0 is installed") as raised:
        refuse_untested("0.20.0")
    assert isinstance(raised.value, RuntimeError)


def test_with_the_override_an_untested_version_warns_instead(monkeypatch, capsys):
    monkeypatch.setenv(OVERRIDE, "1")
    assert refusal("0.20.0") is None
    refuse_untested("0.20.0")
    err = capsys.readouterr().err
    assert err.startswith(f"WARNING: {OVERRIDE}=1: DeepSpeed 0.20.0 is installed, untested")


def fake_install(root: Path, version: str, how: str) -> Path:
    """A DeepSpeed package on its own sys.path entry, as an install leaves it: its version
    in the file setup.py writes, or only in its distribution's metadata. Importing the
    package fails, so a test passing through it shows the version was read, not imported."""
    package = root / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("the fake DeepSpeed was imported")\n')
    if how == "version file":
        (package / "git_version_info_installed.py").write_text(f"version='{version}'\ninstalled_ops={{}}\n")
    else:
        info = root / f"deepspeed-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return root


IMPORT = "import gridwright.deepspeed_internals; print('imported')"


@pytest.mark.parametrize("how", ["version file", "distribution metadata"])
def test_importing_the_fence_under_another_deepspeed_exits_with_the_refusal(tmp_path, how):
    path = fake_install(tmp_path, "0.20.0", how)
    env = {k: v for k, v in os.environ.items() if k != OVERRIDE}
    env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "imported" not in r.stdout
    assert (f"UntestedDeepSpeed: DeepSpeed 0.20.0 is installed; gridwright is tested with deepspeed=={TESTED}"
            in r.stderr), r.stderr[-2000:]
    assert "the fake DeepSpeed was imported" not in r.stderr
    r = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, env=dict(env, **{OVERRIDE: "1"}))
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stderr[-2000:]
    assert "WARNING" in r.stderr and "0.20.0" in r.stderr and "untested" in r.stderr


def test_an_untested_transformers_is_refused_before_a_deepspeed_run_on_the_hugging_face_model(monkeypatch, compose):
    """The DeepSpeed engine's Hugging Face models are one transformers release's classes; another
    is refused in one line at validation (local launch) and again where the job's ranks build."""
    from gridwright.engine_rules import deepspeed_rules
    from gridwright.planning.layout import ParallelLayout
    from gridwright.versions import transformers_version

    monkeypatch.delenv(transformers_version.OVERRIDE, raising=False)
    assert transformers_version.installed_version() == transformers_version.TESTED
    line = transformers_version.refusal("4.57.1")
    assert line.startswith("transformers 4.57.1 is installed; gridwright is tested with transformers==5.24.0 only")
    with pytest.raises(transformers_version.UntestedTransformers):
        transformers_version.refuse_untested("4.57.1")

    monkeypatch.setattr(transformers_version, "installed_version", lambda: "4.57.1")

    def refused(*overrides):
        cfg = compose("engine=deepspeed", "zero=stage1", *overrides)
        return [p for p in deepspeed_rules.problems(cfg, ParallelLayout.from_config(cfg), for_launch=True)
                if p.startswith("transformers ")]

    assert len(refused()) == 1
    assert refused("parallel.tp=2") == []  # Megatron-Core's GPTModel: transformers is not trained
    monkeypatch.setenv(transformers_version.OVERRIDE, "1")
    assert refused() == []
