"""Every rank's output stays in the job directory (logs/rank<N>.log) while the terminal shows
it live, and a failed run ends in one block: the rank that failed first, its error, its log
and, where the cause is known, the fix; the tracebacks go to the ranks' logs only."""
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO

from gridwright.launchers.failure_report import block, is_log_only, log_only, summarise
from gridwright.runtime.jobdir import FAILURE_FILE, LOGS_DIR, node_exits_file, rank_error_file, rank_log

# The fault: rank 1 raises once its step 1 is done. The repository has no fault-injection
# knob, so the test puts one on the workers' PYTHONPATH.
FAULT = '''
import os

if os.environ.get("RANK") == "1":
    from gridwright.runtime.heartbeat import Heartbeat

    _step_done = Heartbeat.step_done

    def step_done(self, step, step_time_s):
        _step_done(self, step, step_time_s)
        if step == 1:
            raise RuntimeError("injected fault: rank 1 after step 1")

    Heartbeat.step_done = step_done
'''


def launch(tmp_path: Path, *args, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, str(REPO / "launch.py"), "tracking=off", "train.warmup_steps=1", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_each_rank_keeps_its_output_and_the_terminal_shows_it_once(tmp_path):
    job = tmp_path / "job"
    result = launch(tmp_path, f"job_dir={job}", "train.steps=3")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["0", "1", "2"], result.stdout[-3000:]  # once each, unprefixed
    rank0 = rank_log(job, 0).read_text().splitlines()
    assert rank0[0].startswith("# rank 0: node 0, local rank 0, attempt 0, started ")
    assert rank0[1:4] == steps and rank0[4].startswith("summary     3 steps: loss ")
    rank1 = rank_log(job, 1).read_text()
    assert rank1.startswith("# rank 1: node 0, local rank 1, attempt 0, started ")
    assert f"torchrun's copies: {job / LOGS_DIR / 'torchrun'}/" in rank1
    torchrun_copy = next((job / LOGS_DIR / "torchrun").glob("*/attempt_0/0/stdout.log")).read_text()
    assert torchrun_copy.splitlines()[:3] == steps
    node0 = (job / LOGS_DIR / "node0.log").read_text()
    assert node0.startswith("# node 0's agent: pid ") and "--nproc_per_node=2" in node0
    assert not list((job / LOGS_DIR).glob("*.error.json")) and not node_exits_file(job, 0).exists()


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_run_in_one_block(tmp_path):
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    job = tmp_path / "job"
    result = launch(tmp_path, f"job_dir={job}", "train.steps=6", pythonpath=tmp_path / "fault")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "step     0 loss " in result.stdout  # the healthy progress before it, as ever
    log = rank_log(job, 1)
    assert result.stderr.splitlines() == [
        "failed      rank 1 first: RuntimeError: injected fault: rank 1 after step 1",
        f"            log: {log} (all it printed; the other ranks' logs are beside it)",
        "            also: rank 0 ended after it",
        f"error: the job failed with exit code 1; see {job}",
    ]
    text = log.read_text()
    assert "[rank1]: Traceback (most recent call last):" in text
    assert "[rank1]:     raise RuntimeError(\"injected fault: rank 1 after step 1\")" in text
    assert text.rstrip().endswith("[rank1]: RuntimeError: injected fault: rank 1 after step 1")
    assert "[rank0]: error: rank 0: stopped because another rank ended first" in rank_log(job, 0).read_text()
    assert json.loads(node_exits_file(job, 0).read_text())["exitcodes"]["1"] == 1


def cut_short_dataset_error(tmp_path: Path) -> ValueError:
    """What Megatron-Core's IndexedDataset raises reading a real dataset whose .bin was cut short."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from gridwright.data.prepare_data import prepare

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(50)))
    prepare([src], tmp_path / "a", "byte")
    os.truncate(tmp_path / "a.bin", 20000)
    dataset = IndexedDataset(str(tmp_path / "a"))
    try:
        dataset[len(dataset) - 1]
    except ValueError as e:
        return e
    raise AssertionError("the cut-short dataset was read")


def record_error(path: Path, error: BaseException, at: float, monkeypatch) -> None:
    """An error file as a failed rank writes it (torch's ErrorHandler, in the except), at `at`."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise error
    except ValueError as e:
        ErrorHandler().record_exception(e)
    os.utime(path, (at, at))


def test_the_rank_that_raised_first_is_named_with_its_fix(tmp_path, monkeypatch):
    job, error = tmp_path / "job", cut_short_dataset_error(tmp_path)
    assert str(error) == "offset must be non-negative and no greater than buffer length (20000)"
    record_error(rank_error_file(job, 0), error, 1_000_002.0, monkeypatch)
    record_error(rank_error_file(job, 1), error, 1_000_001.0, monkeypatch)  # the first
    node_exits_file(job, 0).write_text(json.dumps({"node": 0, "exitcodes": {"0": 1, "1": 1, "2": -15, "3": 1}}))
    rank_log(job, 3).write_text("step     0 loss 5.5\n"
                                "[rank3]: error: rank 3: stopped because another rank ended first\n")
    summary = summarise(job)
    assert [f.rank for f in summary.failures] == [1, 0, 2, 3]
    assert summary.failures[3].error == "error: rank 3: stopped because another rank ended first"
    assert summary.failures[2].says() == "killed by SIGTERM (signal 15)"
    assert block(job, 1) == [
        f"failed      rank 1 first: ValueError: {error}",
        f"            log: {rank_log(job, 1)} (all it printed; the other ranks' logs are beside it)",
        "            fix: a .bin in data.paths holds fewer bytes than its .idx lists (cut short or corrupt): "
        "prepare it again with python -m gridwright.data.prepare_data",
        "            also: rank 0 raised the same error; ranks 2-3 ended after it",
        f"error: the job failed with exit code 1; see {job}",
    ]
    # Records from before the run started (a re-run job directory's) are not this run's.
    later = summarise(job, since=2_000_000.0).failures
    assert [f.rank for f in later] == [0, 1, 2, 3] and all(f.raised_at is None for f in later)


def test_a_rank_killed_without_a_word_is_named_from_its_exit_code(tmp_path):
    node_exits_file(tmp_path, 1).parent.mkdir(parents=True)
    node_exits_file(tmp_path, 1).write_text(json.dumps({"exitcodes": {"4": 1, "5": -int(signal.SIGKILL)}}))
    rank_log(tmp_path, 4).write_text("[rank4]: error: rank 4: stopped because another rank ended first (gloo)\n")
    lines = block(tmp_path, 1)
    assert lines[0] == "failed      rank 5 first: killed by SIGKILL (signal 9)"
    assert lines[2].startswith("            fix: SIGKILL with nothing said: unless someone stopped it, the kernel's "
                               "out-of-memory killer")
    assert lines[3] == "            also: rank 4 ended after it"


def test_without_rank_records_the_logging_ranks_failure_is_used(tmp_path):
    (tmp_path / FAILURE_FILE).write_text(json.dumps({"error": "OutOfMemoryError: CUDA out of memory. Tried to "
                                                              "allocate 2.00 GiB"}))
    lines = block(tmp_path, 1)
    assert lines[0] == ("failed      the logging rank first: OutOfMemoryError: CUDA out of memory. Tried to "
                        "allocate 2.00 GiB")
    assert lines[1].startswith("            fix: the GPU ran out of memory: lower train.micro_batch_size")
    assert block(tmp_path / "empty", 1)[0].startswith("failed      no rank left an error or an exit code")


def test_log_only_lines_are_marked_as_torch_marks_a_rank_traceback():
    text = log_only(3, "Traceback (most recent call last):\n\n  File \"x.py\", line 1\nValueError: bad\n")
    assert text.splitlines() == ["[rank3]: Traceback (most recent call last):", "[rank3]:",
                                 "[rank3]:   File \"x.py\", line 1", "[rank3]: ValueError: bad"]
    assert all(is_log_only(line) for line in text.splitlines())
    assert not is_log_only("[rank0]:[W1128 06:26:32 ProcessGroupGloo.cpp:1] Warning: a C++ warning stays")
    assert not is_log_only("step     1 loss 5.5")


def test_the_terminal_copy_leaves_out_what_is_for_the_log_only(tmp_path):
    from gridwright.launchers.agent import _LineFile, _RankStream

    log, terminal = _LineFile(tmp_path / "rank0.log"), io.StringIO()
    stream = _RankStream(log, terminal, threading.Lock())
    # As torch's TailLog hands them on: a line may come in pieces while it is being written.
    for piece in ["step 0 lo", "ss 5.5\n", "[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: x\n",
                  "\n", "\n", "error: rank 0: said on the terminal\n", "no newline yet"]:
        stream.write(piece)
    stream.close()
    log.close()
    assert terminal.getvalue().splitlines() == ["step 0 loss 5.5", "error: rank 0: said on the terminal",
                                                "no newline yet"]
    assert (tmp_path / "rank0.log").read_text().splitlines() == [
        "step 0 loss 5.5", "[rank0]: Traceback (most recent call last):", "[rank0]: ValueError: x", "", "",
        "error: rank 0: said on the terminal", "no newline yet"]
