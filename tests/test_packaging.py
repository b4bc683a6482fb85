"""A non-editable install (the wheel) works from any directory, configs included."""
import subprocess
import sys

from conftest import REPO
import pytest


@pytest.mark.slow
def test_wheel_installs_and_plans_from_anywhere(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("gridwright-*.whl")
    # A venv that sees this interpreter's packages (torch, Megatron-Core, ...) but gets
    # gridwright itself only from the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    py, cli = venv / "bin" / "python", venv / "bin" / "gridwright"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([str(py), "-c", "import gridwright.config.compose as c; print(c.__file__); print(c.CONF_DIR)"],
                           cwd=away, capture_output=True, text=True, check=True).stdout.split()
    assert all(str(venv) in w for w in where), where  # the installed copy and its own conf/
    for cmd in ([str(cli), "+experiment=mixtral_ep8", "launcher=plan"],
                [str(py), "-m", "gridwright", "+experiment=llama3_8b", "launcher=plan"]):
        r = subprocess.run(cmd, cwd=away, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "launcher=plan: nothing started." in r.stdout
    assert {p.name for p in (away / "jobs").iterdir()} == {"mixtral_ep8", "llama3_8b"}
    assert list((away / "jobs" / "mixtral_ep8").glob("*/plan.json"))


def test_ci_runs_the_readmes_test_command():
    """CI must run exactly what the README's quick start tells a developer to run, and a
    failing tier must fail CI: the command is the last line of .ci/run, which sets -e."""
    import re

    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("```bash", 1)[1].split("```", 1)[0]  # the first block: the quick start
    commands = [re.split(r"\s+#\s", line)[0].strip() for line in quick_start.strip().splitlines()]
    assert len(commands) == 2, commands  # one runs the main job, one the tests
    test_command = commands[1]
    assert test_command.startswith("python -m pytest") and '-m "not slow"' in test_command and "-m slow" in test_command
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_command and "set -euo pipefail" in ci
