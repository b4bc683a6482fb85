"""The GPU test tier, run and recorded: `pytest -m gpu` on this machine's GPU, and a results
file that names the card, torch, Transformer Engine and the commit.

    python -m gridwright.evaluations.gpu_tier [--out DIR] [--budget S] [--resume FILE] [-- PYTEST ARGS]

Here a skipped test counts as a failure: the tier exists to run on a GPU with TE, so a
skip means it did not. Exit 1 when any test failed, skipped or was not run.

The whole tier takes longer than one command may run on the GPU machines (about 9 minutes
on 1 x H200 from a cold start, against a 10-minute limit with set-up), so it can be run in
parts: `--budget S` interrupts it after S seconds (the running test's processes end with it)
and records the tests not run; `--resume FILE` (the `.json` an earlier part wrote) keeps the tests that passed there,
each with its own call's commit and time, and runs the rest.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gridwright.evaluations.results_file import card_of_this_machine, commit_here, write_json, write_markdown

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


# This module is also the tier's pytest plugin (`-p gridwright.evaluations.gpu_tier`): each
# test's result is appended to this file as it ends, so an interrupted or killed pytest
# loses only the test it was running (a junit file is written at the end or not at all).
REPORTS_ENV = "GRIDWRIGHT_GPU_TIER_REPORTS"


def pytest_runtest_logreport(report) -> None:
    """pytest's hook, per phase of each test: record the call's result and any phase that
    did not pass (a skip or an error in setup, an error in teardown)."""
    path = os.environ.get(REPORTS_ENV)
    if not path or (report.when != "call" and report.passed):
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else str(report.longrepr or "")
    record = {"test": test_name(report.nodeid), "outcome": report.outcome, "seconds": report.duration,
              "reason": (reason.strip().splitlines() or [""])[0].removeprefix("Skipped: ")[:160]}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def outcomes(reports: Path) -> dict[str, tuple[str, float, str]]:
    """{test: (passed|failed|skipped, seconds, first line of the reason)} from the plugin's file."""
    out: dict[str, tuple[str, float, str]] = {}
    for line in reports.read_text().splitlines() if reports.exists() else []:
        r = json.loads(line)
        result = {"passed": "passed", "skipped": "skipped"}.get(r["outcome"], "failed")
        before, seconds, why = out.get(r["test"], ("passed", 0.0, ""))
        if before == "passed":  # else the first phase that did not pass decides
            before, why = result, r["reason"] if result != "passed" else ""
        out[r["test"]] = (before, seconds + r["seconds"], why)
    return out


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


def table(rows: list[dict]) -> str:
    lines = ["| test | result | seconds | call | reason |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{r['test']}` | {r['result']} | {r['seconds']:.1f} | {r['call']} | {r['reason'].replace('|', '/')} |"
              for r in rows]
    return "\n".join(lines)


# Flags that change how much pytest prints: at any net verbosity but -1 `--collect-only`
# prints a tree, not test ids, so they are left out of the collection (a `-v` once made it
# find no tests at all).
VERBOSITY_FLAGS = re.compile(r"-[vqs]+|--verbose|--quiet|--capture=.*")


class NothingCollected(Exception):
    """A tier of no tests would be recorded as "0 of 0 passed"; it is an error instead."""


def collected(base: list[str], pytest_args: list[str]) -> list[str]:
    """The tier's test ids, in the order pytest runs them."""
    selecting = [a for a in pytest_args if not VERBOSITY_FLAGS.fullmatch(a)]
    done = subprocess.run([*base, *selecting, "--collect-only", "-q"], cwd=REPO, capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        last = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:] or ["(nothing printed)"]
        raise NothingCollected(f"error: pytest collected no GPU tests here: {last[0]}")
    return ids


def test_name(node_id: str) -> str:
    """`tests/test_x.py::test_y[a]` as the results file names it: `test_x::test_y[a]`."""
    path, _, rest = node_id.partition("::")
    return f"{Path(path).stem}::{rest}"


# Seconds kept back from --budget for interrupting pytest and writing the file: on 1 x H200
# collecting the tier took about 20 s of a 270 s call, and a budget counted from pytest's start
# let the caller's limit end the command before it had written anything.
WRAP_UP_S = 30.0


def run_pytest(cmd: list[str], budget_s: float | None, reports: Path) -> None:
    """Run pytest; past the budget, interrupt it as Ctrl-C would."""
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, REPORTS_ENV: str(reports)})
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        print(f"gpu_tier: the budget of {budget_s:g} s is spent: interrupting the running test "
              "(it and those after it are recorded as not run)", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=WRAP_UP_S - 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def not_run_because(selected: bool, budget: float | None) -> str:
    if not selected:
        return "not selected in this call (its pytest arguments)"
    return "the budget was spent" if budget else "did not report"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    ap.add_argument("--test-timeout", type=int, default=240,
                    help="seconds after which one test fails as hung (pytest-timeout, where it is installed), so "
                         "that a hung test cannot keep the tier from writing its file")
    ap.add_argument("--budget", type=float, help="seconds from this command's start (collection included) after "
                    "which the tier is interrupted; the tests not finished are recorded as not run")
    ap.add_argument("--resume", type=Path, help="an earlier part's .json: its passed tests are kept, not run again")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    started = time.monotonic()
    gpu = machine()
    earlier = json.loads(args.resume.read_text()) if args.resume else {"rows": []}
    if args.resume and earlier.get("machine") != gpu:
        print(f"error: {args.resume} was recorded on {earlier.get('machine')}, not on {gpu}", file=sys.stderr)
        return 2
    kept = [r for r in earlier["rows"] if r["result"] == "passed"]
    reports = Path(tempfile.mkdtemp(prefix="gpu_tier_")) / "reports.jsonl"
    # addopts without xdist's -n (one GPU, and the GPU machines need not have xdist)
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=-ra --strict-markers", "-p", "no:cacheprovider",
            *gpu_test_files()]
    try:
        tier = collected(base, [])
        wanted = set(collected(base, args.pytest_args)) if args.pytest_args else set(tier)
    except NothingCollected as e:
        print(e, file=sys.stderr)
        return 2
    skip = {r["test"] for r in kept}
    cmd = [*base, *args.pytest_args, "-p", "gridwright.evaluations.gpu_tier", *per_test_bound(args.test_timeout),
           *(f"--deselect={t}" for t in tier if test_name(t) in skip)]
    print("+", " ".join(cmd), flush=True)
    # What is left of the budget, less the time the interruption and the file take
    run_pytest(cmd, None if args.budget is None else max(1.0, args.budget - (time.monotonic() - started) - WRAP_UP_S), reports)
    call = f"{commit_here() or 'unknown'} {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}"
    ran = {n: {"test": n, "result": r, "seconds": s, "call": call, "reason": why}
           for n, (r, s, why) in outcomes(reports).items()}
    by_name = {r["test"]: r for r in kept} | ran
    rows = [by_name.get(test_name(t)) or {"test": test_name(t), "result": "not run", "seconds": 0.0, "call": call,
                                         "reason": not_run_because(t in wanted, args.budget)}
            for t in tier]
    listed = {row["test"] for row in rows}
    rows += [r for n, r in ran.items() if n not in listed]  # none, unless collection erred
    passed = sum(r["result"] == "passed" for r in rows)
    verdict = "passed" if rows and passed == len(rows) else "FAILED"
    calls = sorted({r["call"] for r in rows})
    text = (f"GPU: {gpu}\n\n**{verdict}**: {passed} of {len(rows)} passed "
            f"(a skip counts as a failure here), in {len(calls)} call{'s' * (len(calls) > 1)} "
            "(`--budget`, `--resume`).\n\n" + table(rows))
    card = card_of_this_machine()
    command = "python -m gridwright.evaluations.gpu_tier" + (" --resume" if args.resume else "")
    path = write_markdown(args.out, NAME, card, command, text, title="The GPU test tier")
    write_json(args.out, NAME, card, {"machine": gpu, "verdict": verdict, "rows": rows})
    print(text, f"\nwritten: {path}", sep="\n", flush=True)
    return 0 if verdict == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
