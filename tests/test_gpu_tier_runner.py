"""The GPU tier's runner on any machine: its pytest plugin records each test as it ends, so a
part cut short by its budget keeps what it ran; and no tests collected is an error."""
import os
import subprocess
import sys

from gridwright.evaluations.gpu_tier import REPORTS_ENV, outcomes

TESTS = '''
import pytest

def test_adds():
    assert 1 + 1 == 2

def test_breaks():
    assert 1 + 1 == 3, "arithmetic"

@pytest.mark.skip(reason="no GPU here")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise OSError("no device")

def test_errs_in_setup(broken):
    pass
'''


def test_each_result_is_recorded_with_its_reason(tmp_path):
    (tmp_path / "test_some.py").write_text(TESTS)
    reports = tmp_path / "reports.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "gridwright.evaluations.gpu_tier", "-p", "no:cacheprovider",
                           "-o", "addopts=", "test_some.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, REPORTS_ENV: str(reports)}, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:]
    got = outcomes(reports)
    assert {t: r[0] for t, r in got.items()} == {
        "test_some::test_adds": "passed", "test_some::test_breaks": "failed",
        "test_some::test_skipped": "skipped", "test_some::test_errs_in_setup": "failed"}
    assert got["test_some::test_skipped"][2] == "no GPU here"
    assert got["test_some::test_breaks"][2].startswith("AssertionError: arithmetic")
    assert got["test_some::test_errs_in_setup"][2] == "OSError: no device"


def test_a_call_that_selects_no_tests_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gridwright.evaluations.gpu_tier", "--out", str(tmp_path), "--",
                           "-v", "-k", "no_such_test"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith("error: pytest collected no GPU tests here: no tests collected"), done.stderr
    assert not list(tmp_path.iterdir())  # no file claiming "0 of 0"


def test_a_resumed_part_keeps_what_an_earlier_part_passed(tmp_path):
    """--resume keeps an earlier call's passed rows with that call, deselects them, and runs
    the rest (here on CPU, where they skip, and so count as failures)."""
    import json

    from gridwright.evaluations.gpu_tier import machine

    kept = "test_gpu_tier::test_transformer_engine_linear_computes_in_fp8[DelayedScaling]"
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"machine": machine(), "rows": [
        {"test": kept, "result": "passed", "seconds": 0.5, "call": "abc1234 2026-12-04 10:00", "reason": ""}]}))
    done = subprocess.run([sys.executable, "-m", "gridwright.evaluations.gpu_tier", "--out", str(tmp_path / "out"),
                           "--resume", str(earlier), "--", "-k", "linear_computes"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    (written,) = (tmp_path / "out").glob("gpu_tier_*.json")
    rows = {r["test"]: r for r in json.loads(written.read_text())["rows"]}
    assert rows[kept]["result"] == "passed" and rows[kept]["call"] == "abc1234 2026-12-04 10:00"
    other = rows[kept.replace("DelayedScaling", "Float8CurrentScaling")]
    assert other["result"] == "skipped" and other["call"] != rows[kept]["call"]
    assert {r["result"] for t, r in rows.items() if "linear_computes" not in t} == {"not run"}
    assert "2 calls" in (tmp_path / "out" / written.name.replace(".json", ".md")).read_text()
