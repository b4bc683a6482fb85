"""Why a failed job failed, in one short block, read from its job directory.

A failed run used to print every rank's traceback, interleaved (109 lines for two ranks
reading a cut-short dataset). What the user needs is which rank failed first, its error in
one line, where to read the rest and, where the cause is known, what to change. The job
directory holds it (layout in gridwright.runtime.jobdir):

* `logs/rank<N>.error.json`: torchrun's error file, written by a rank whose error nothing
  handled (gridwright.launchers.worker): "Type: message", the traceback, and when;
* `logs/node<K>.exits.json`: the exit code torchrun saw for each failed rank of node K (a
  rank killed by a signal leaves no error file);
* `logs/rank<N>.log`: all the rank printed, tracebacks included;
* `hangs/`: the watchdog's finding when it stopped the job; `failure.json`: the logging
  rank's error, the one record when no rank left an error file.

A traceback goes to its rank's log, not to the terminal: the worker writes it with each line
prefixed `[rank<N>]: ` (`log_only`), as torch.distributed's own excepthook prefixes one, and
the agent's copy of the ranks' output on the terminal leaves such lines out (`is_log_only`).
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from gridwright.runtime.jobdir import FAILURE_FILE, LOGS_DIR, rank_log, read_json
from .peer_agents import AGENTS_DIR, LOST_FILE, loss_after

_LOG_ONLY = re.compile(r"\[rank\d+\]:( |$)")  # torch's C++ lines, `[rank0]:[W ...`, stay on the terminal
_ERROR_FILE = re.compile(r"rank(\d+)\.error\.json")
# The last line of a traceback ("Type: message"), or a line a rank printed to say why it stopped.
_ERROR_LINE = re.compile(r"(error: .+|[\w.]*(?:Error|Exception|Interrupt|Exit|Failure)\b: .*)")

# Failures whose cause is known: (what the error or the end of the rank's log says, the fix).
# The texts are numpy's frombuffer (what Megatron-Core's IndexedDataset meets in a cut-short
# .bin, reproduced), torch's CUDA caching allocator, and gloo's and NCCL's collective timeouts.
KNOWN_FAILURES = (
    (re.compile(r"indexed_dataset\.py[\s\S]*(offset must be non-negative and no greater than buffer length"
                r"|buffer is smaller than requested size)"),
     "a .bin in data.paths holds fewer bytes than its .idx lists (cut short or corrupt): prepare it again "
     "with python -m gridwright.data.prepare_data"),
    (re.compile(r"CUDA out of memory"),
     "the GPU ran out of memory: lower train.micro_batch_size (more accumulation keeps "
     "train.global_batch_size), or recompute activations (train.recompute=selective, or full)"),
    (re.compile(r"Watchdog caught collective operation timeout|Timed out waiting \d+ ?ms"),
     "a collective timed out: another rank stalled or died first; see the hang report (hangs/ in the job "
     "directory) and the other ranks' logs"),
    (re.compile(r"^killed by SIGKILL"),
     "SIGKILL with nothing said: unless someone stopped it, the kernel's out-of-memory killer is the usual "
     "cause (dmesg shows it); lower train.micro_batch_size"),
)


def log_only(rank: int, text: str) -> str:
    """`text` with every line marked for rank `rank`'s log only."""
    return "".join(f"[rank{rank}]: {line}".rstrip() + "\n" for line in text.splitlines())


def is_log_only(line: str) -> bool:
    return bool(_LOG_ONLY.match(line))


@dataclass
class RankFailure:
    """How one rank ended, as the job directory tells it."""

    rank: int | None  # None: the logging rank, known from failure.json only
    error: str = ""  # one line: the exception's "Type: message", or the last error line of its log
    exitcode: int | None = None  # as torchrun saw it; negative: killed by that signal
    raised_at: float | None = None  # when its error file was written: the rank raised
    text: str = ""  # its traceback, or the end of its log: what KNOWN_FAILURES are matched against

    def says(self) -> str:
        if self.raised_at is None and self.exitcode is not None and self.exitcode < 0:
            return f"killed by {_signal_name(-self.exitcode)} (signal {-self.exitcode})"
        if self.error:
            return self.error
        return f"exited with code {self.exitcode}" if self.exitcode is not None else "no error recorded"

    def order(self) -> tuple:
        """Earliest cause first: a rank that raised (by when), then one killed by a signal not
        torchrun's own (SIGTERM ends the others), then the ranks that ended after those."""
        if self.raised_at is not None:
            return 0, self.raised_at
        if self.exitcode is not None and self.exitcode < 0 and -self.exitcode not in (signal.SIGTERM, signal.SIGINT):
            return 1, 0.0
        return 2, 0.0


@dataclass
class Summary:
    failures: list[RankFailure] = field(default_factory=list)  # the first cause first
    hang: dict | None = None  # the watchdog's finding, when it stopped the job

    @property
    def first(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    @property
    def fix(self) -> str | None:
        first = self.first
        if first is None:
            return None
        for pattern, fix in KNOWN_FAILURES:
            if pattern.search(first.says()) or pattern.search(first.text):
                return fix
        return None


def summarise(job_dir: Path, since: float = 0.0) -> Summary:
    """The job's failed ranks, the first cause first, from the records written since `since`
    (the run's start: a re-run job directory holds an earlier run's)."""
    job_dir = Path(job_dir)
    logs = job_dir / LOGS_DIR
    by_rank: dict[int, RankFailure] = {}
    for path in _written_since(logs.glob("rank*.error.json"), since):
        rank = int(_ERROR_FILE.fullmatch(path.name)[1])
        message, trace = _error_file(path)
        by_rank[rank] = RankFailure(rank, error=_one_line(message), raised_at=path.stat().st_mtime,
                                    text=f"{trace}\n{message}")
    for path in _written_since(logs.glob("node*.exits.json"), since):
        for rank, code in read_json(path).get("exitcodes", {}).items():
            by_rank.setdefault(int(rank), RankFailure(int(rank))).exitcode = code
    for failure in by_rank.values():
        if failure.raised_at is None:  # what it printed last says why, if anything does
            failure.text = _log_tail(rank_log(job_dir, failure.rank))
            failure.error = _last_error_line(failure.text)
    failures = sorted(by_rank.values(), key=lambda f: (*f.order(), f.rank))
    if not failures and list(_written_since([job_dir / FAILURE_FILE], since)):
        error = read_json(job_dir / FAILURE_FILE).get("error", "")
        failures = [RankFailure(None, error=_one_line(error), text=error)]
    return Summary(failures, _hang(job_dir, since))


def block(job_dir: Path, exit_code: int, since: float = 0.0) -> list[str]:
    """What a failed run prints, instead of every rank's traceback: the rank that failed
    first and its error, its log, the fix when the cause is known, and the job directory."""
    job_dir = Path(job_dir)
    summary = summarise(job_dir, since)
    first, hang = summary.first, summary.hang
    logs = job_dir / LOGS_DIR
    lost = loss_after(job_dir, since)
    if lost is not None:  # the ranks' errors follow from it (their peers' collectives broke)
        return [f"failed      {lost}; the other agents ended the job (see {job_dir / AGENTS_DIR / LOST_FILE})",
                f"error: the job failed with exit code {exit_code}; see {job_dir}"]
    if hang is not None:
        step = "before its first step" if hang["step"] is None else f"after step {hang['step']}"
        lines = [f"failed      rank {hang['rank']} hung: no progress for {hang['silent_s']:g} s {step}; the "
                 f"watchdog stopped the job (its report is above and in {job_dir / 'hangs'})"]
        rank = hang["rank"]
    elif first is not None:
        who = "the logging rank" if first.rank is None else f"rank {first.rank}"
        lines = [f"failed      {who} first: {first.says()}"]
        rank = first.rank
    else:
        lines = [f"failed      no rank left an error or an exit code; see what the agent said in {logs}"]
        rank = None
    if rank is not None:
        lines.append(f"            log: {rank_log(job_dir, rank)} "
                     "(all it printed; the other ranks' logs are beside it)")
    if hang is None and summary.fix:
        lines.append(f"            fix: {summary.fix}")
    rest = [f for f in summary.failures if f.rank is not None and f.rank != rank]
    same = [f.rank for f in rest if first is not None and f.raised_at is not None and f.error == first.error]
    after = [f.rank for f in rest if f.rank not in same]
    also = ([f"{_ranks(same)} raised the same error"] if same else []) + ([f"{_ranks(after)} ended after it"]
                                                                          if after else [])
    if also:
        lines.append(f"            also: {'; '.join(also)}")
    lines.append(f"error: the job failed with exit code {exit_code}; see {job_dir}")
    return lines


def _written_since(paths, since: float) -> list[Path]:
    out = []
    for path in paths:
        try:
            if path.stat().st_mtime >= since:
                out.append(path)
        except OSError:
            continue
    return sorted(out)


def _error_file(path: Path) -> tuple[str, str]:
    """(message, traceback) from a torchrun error file, in either of its formats."""
    message = read_json(path).get("message", "")
    if isinstance(message, dict):
        return str(message.get("message", "")), str(message.get("extraInfo", {}).get("py_callstack", ""))
    return str(message), ""


# Where a message's advice begins: gridwright's "Fix:" and the forms upstream errors use
# (Transformer Engine: "To load it anyway, set NVTE_...=1").
_ADVICE = re.compile(r"(?:\bFix:|\bTo [a-z][\w ]* anyway\b|\b[Ss]et [A-Z][A-Z0-9_]+=|\b[Ss]et [a-z_]+\.[\w.]+=)")


def _one_line(message: str, most: int = 300) -> str:
    """A message's first lines as one line (a placement error names the mismatch on its
    second). A long one is shortened in the middle, never through its advice: the part
    from where the advice begins is kept whole."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    if len(text) <= most:
        return text
    # the earliest advice that fits, so that all of it is kept
    advice = next((text[m.start():] for m in _ADVICE.finditer(text) if len(text) - m.start() <= most - 45), "")
    if not advice:
        return text[: most - 3] + "..."
    head = text[: max(most - len(advice) - 5, 40)].rstrip()
    return f"{head} ... {advice}"


def _log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _last_error_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        match = _ERROR_LINE.fullmatch(_LOG_ONLY.sub("", line, count=1).strip())
        if match:
            return _one_line(match[1])
    return ""


def _hang(job_dir: Path, since: float) -> dict | None:
    from .watchdog import findings

    found = findings(job_dir, since)
    return found[0] if found else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _ranks(ranks: list[int]) -> str:
    """`rank 3` or `ranks 0, 2-7`."""
    ranks, spans = sorted(set(ranks)), []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    words = [str(a) if a == b else f"{a}-{b}" for a, b in spans]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(words)
