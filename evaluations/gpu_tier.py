"""The GPU test tier, run and recorded: `pytest -m gpu` on this machine's GPU, and a results
file that names the card, torch, Transformer Engine and the commit.

    python -m gridwright.evaluations.gpu_tier [--out DIR] [-- PYTEST ARGS]

Here a skipped test counts as a failure: the tier exists to run on a GPU with TE, so a
skip means it did not. Exit 1 when any test failed or skipped.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from gridwright.evaluations.results_file import card_of_this_machine, write_markdown

REPO = Path(__file__).resolve().parents[1]
NAME = "gpu_tier"


def machine() -> str:
    import torch

    from gridwright.evaluations.bench_gpu import te_version

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return f"{torch.cuda.device_count()} x {card}, torch {torch.__version__}{te_version() or ', no Transformer Engine'}"


def gpu_test_files() -> list[str]:
    """The test modules that hold GPU tests (collecting the others would import what the GPU
    machines lack, such as MLflow)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def outcomes(junit: Path) -> list[tuple[str, str, float, str]]:
    """(test, passed|failed|skipped, seconds, first line of the reason) per test case."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        result, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                result = "skipped" if tag == "skipped" else "failed"
                reason = (found.get("message") or "").strip().splitlines()[0][:160] if found.get("message") else ""
                break
        rows.append((name, result, float(case.get("time", 0)), reason))
    return rows


def per_test_bound(seconds: int) -> list[str]:
    """pytest-timeout's arguments where it is installed (the GPU machines have it); without
    it a hung test holds the tier until the caller's own limit, and no file is written."""
    import importlib.util

    if importlib.util.find_spec("pytest_timeout") is None:
        print("gpu_tier: pytest-timeout is not installed; a hung test will hang the tier", flush=True)
        return []
    from importlib.metadata import entry_points

    # installed as a distribution, pytest loads it by its entry point; naming it again fails
    registered = any(ep.value == "pytest_timeout" for ep in entry_points(group="pytest11"))
    return ([] if registered else ["-p", "pytest_timeout"]) + [f"--timeout={seconds}"]


def table(rows) -> str:
    lines = ["| test | result | seconds | reason |", "| --- | --- | --- | --- |"]
    lines += [f"| `{n}` | {r} | {s:.1f} | {why.replace('|', '/')} |" for n, r, s, why in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    ap.add_argument("--test-timeout", type=int, default=240,
                    help="seconds after which one test fails as hung (pytest-timeout, where it is installed), so "
                         "that a hung test cannot keep the tier from writing its file")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    junit = Path(tempfile.mkdtemp(prefix="gpu_tier_")) / "junit.xml"
    # addopts without xdist's -n (one GPU, and the GPU machines need not have xdist)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=-ra --strict-markers", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *per_test_bound(args.test_timeout), *gpu_test_files(), *args.pytest_args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO)
    rows = outcomes(junit) if junit.exists() else []
    passed = sum(r[1] == "passed" for r in rows)
    verdict = "passed" if rows and passed == len(rows) else "FAILED"
    gpu = machine()
    text = (f"GPU: {gpu}\n\n**{verdict}**: {passed} of {len(rows)} passed "
            "(a skip counts as a failure here).\n\n" + table(rows))
    path = write_markdown(args.out, NAME, card_of_this_machine(), "python -m gridwright.evaluations.gpu_tier", text,
                          title="The GPU test tier")
    print(text, f"\nwritten: {path}", sep="\n", flush=True)
    return 0 if verdict == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
