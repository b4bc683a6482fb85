"""The per-node agent of every launcher: torchrun, wrapped so that a run ends whole.

    python -m gridwright.launchers.agent --job-dir DIR [torchrun options]

runs torchrun's agent in this process with `-m gridwright.launchers.worker --job-dir DIR` as the
entry point, and adds what torchrun leaves out:

* every process it starts carries this node's run token (gridwright.runtime.process_tree), and
  whatever still carries it when torchrun returns (a dead worker's children) is ended;
* started by the local launcher (GRIDWRIGHT_LAUNCHER_PIPE=1), it follows the launcher
  through a pipe on its stdin: a `stop` line or the pipe's end (the launcher died, even
  by SIGKILL) makes it SIGTERM itself, once, and torchrun then stops the workers. Once:
  a second SIGTERM in the middle of torchrun's shutdown would cut the workers' save;
* `--rdzv-backend=gridwright-loopback` is torchrun's static rendezvous with its store
  listening on the endpoint's address only (torch's TCPStore otherwise listens on every
  interface): the local launcher's rendezvous is unreachable from other hosts;
* on node 0 it owns the job's MLflow run: it opens the run before the workers start (they
  log their step metrics into it: MLFLOW_RUN_ID), and closes it as finished, failed or
  killed when torchrun returns, with what the job directory holds (summary, hang report,
  the logging rank's error). Killed outright (SIGKILL), it leaves the run RUNNING for the
  next look at the job directory (the local launcher, `gridwright.tracking.sync`, a re-run)
  to close (gridwright.tracking.run_owner);
* it keeps what every process printed in the job directory's `logs/` (`Console`), whichever
  launcher started it, while the terminal (or Slurm's output file) shows it live as before:

      logs/rank<N>.log         rank N's stdout and stderr, whole (tracebacks included), this run's
                               latest attempt; its first line says which process it was
      logs/node<K>.log         this agent's own output, torchrun's log records included
      logs/rank<N>.error.json  torchrun's error file of a rank that raised
      logs/node<K>.exits.json  the exit codes torchrun saw for this node's failed ranks
      logs/torchrun/           torchrun's own files, every attempt kept:
                               <run id>_<random>/attempt_<A>/<local rank>/stdout.log, stderr.log

  torchrun writes the ranks' files (its LogsSpecs, with `--redirects`); the copies in
  logs/rank<N>.log and on the terminal are made by torch's TailLog, as `--tee` would, but
  unprefixed and without the lines a rank marks for its log only (its traceback);
* a failed job's ranks are summed up in one block (gridwright.launchers.failure_report): by
  the local launcher once the run has ended, or here on the other launchers' nodes.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from gridwright.runtime.process_tree import TOKEN_ENV, end_run_processes, new_token

LAUNCHER_PIPE_ENV = "GRIDWRIGHT_LAUNCHER_PIPE"
STOP_LINE = "stop"
LOOPBACK_BACKEND = "gridwright-loopback"


def _loopback_rendezvous(params):
    """A one-node rendezvous whose store listens on the endpoint's address only (torch's
    TCPStore takes a socket bound here through `master_listen_fd`). Each round (each
    elastic restart) gets a fresh store on a fresh port: workers find their peers'
    addresses in it, and the previous round's would be stale (torch's static rendezvous
    keeps one store for every round)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, first_port = parse_rendezvous_endpoint(params.endpoint, -1)
    if params.max_nodes != 1:
        raise ValueError(f"{LOOPBACK_BACKEND} serves one node; --nnodes={params.max_nodes}")
    timeout = datetime.timedelta(seconds=int(params.config.get("timeout", 900)))

    class LoopbackRendezvous(RendezvousHandler):
        def __init__(self):
            self._round = 0
            self._kept = []  # the current round's listening socket and store

        def get_backend(self) -> str:
            return LOOPBACK_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # The launcher's free port may have been taken since it looked (by another
            # process's ephemeral port): then any port; the workers learn it from here.
            try:
                listener.bind((host, first_port if self._round == 0 else 0))
            except OSError:
                listener.bind((host, 0))
            listener.listen(1024)
            port = listener.getsockname()[1]
            store = dist.TCPStore(host, port, 1, True, timeout, multi_tenant=True, master_listen_fd=listener.fileno())
            self._round += 1
            self._kept = [listener, store]
            return RendezvousInfo(dist.PrefixStore(params.run_id, store), 0, 1, RendezvousStoreInfo(host, port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self):
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return params.run_id

        def shutdown(self) -> bool:
            return True

    return LoopbackRendezvous()


def _register_loopback_backend() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _loopback_rendezvous)


def _follow_launcher() -> None:
    """Stop (SIGTERM to this process, once) when the launcher says so or ends."""
    def watch():
        for line in sys.stdin:
            if line.strip() == STOP_LINE:
                break
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-pipe", daemon=True).start()


def _split_job_dir(argv: list[str]) -> tuple[Path, list[str]]:
    if len(argv) < 2 or argv[0] != "--job-dir":
        sys.exit("usage: python -m gridwright.launchers.agent --job-dir DIR [torchrun options]")
    return Path(argv[1]).resolve(), argv[2:]


def main(argv: list[str] | None = None) -> int:
    job_dir, torchrun_args = _split_job_dir(sys.argv[1:] if argv is None else argv)
    node = node_rank(torchrun_args)
    console = Console(job_dir, node, torchrun_args)  # before torch is imported: its log handlers take sys.stderr then
    if os.environ.get(LAUNCHER_PIPE_ENV) == "1":
        _follow_launcher()
    token = os.environ.setdefault(TOKEN_ENV, new_token())
    stopped_by = {}
    started = time.time()

    def note_signal(signum, frame):  # torchrun replaces this once it starts the workers
        stopped_by["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, note_signal)
    run = JobRun.open(job_dir, torchrun_args)
    code = 1
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        console.keep_torch_logs_in_file()
        _register_loopback_backend()
        watchdog = _start_watchdog(job_dir, token, node, nodes_of(torchrun_args))
        try:
            _torchrun(job_dir, torchrun_args, console)
            code = 0
        except ChildFailedError as e:  # a worker that refused its input (exit 2) has said why in one line;
            code = 2 if e.get_first_failure()[1].exitcode == 2 else 1  # torchrun then ended the others
            _record_exits(job_dir, node, e.failures)
        except SignalException as e:
            stopped_by["signal"] = int(e.sigval)
            code = 128 + int(e.sigval)
        finally:
            if watchdog is not None:
                watchdog.stop()
            console.stop_following()  # the ranks' last lines before what the agent says next
    except KeyboardInterrupt:
        code = 128 + stopped_by.get("signal", signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the clean-up below
        left = end_run_processes(token)
        if left:
            print(f"agent       ended {left} process(es) the workers left behind", file=sys.stderr, flush=True)
        if run is not None:
            run.close(code, stopped_by.get("signal"), since=started)
        if code not in (0, 2) and "signal" not in stopped_by and os.environ.get(LAUNCHER_PIPE_ENV) != "1":
            from gridwright.launchers.failure_report import block  # the local launcher prints it itself

            print("\n".join(block(job_dir, code, since=started)), file=sys.stderr, flush=True)
        console.close()
    return code


def _torchrun(job_dir: Path, torchrun_args: list[str], console: "Console") -> None:
    """torchrun (torch.distributed.run's `run`) with this job's LogsSpecs (`_rank_logs`).
    torchrun takes another LogsSpecs only from an installed entry point (`--logs-specs`), so
    its launch config is built here from the same arguments; of what `run` adjusts, only the
    port's default applies (gridwright's launchers never ask for --standalone)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args([*torchrun_args, "-m", "gridwright.launchers.worker", "--job-dir", str(job_dir)])
    if args.master_port is None:
        args.master_port = 29500  # as torchrun's run() does
    config, entrypoint, entry_args = config_from_args(args)
    config.logs_specs = _rank_logs(job_dir, console)
    elastic_launch(config, entrypoint)(*entry_args)


def _rank_logs(job_dir: Path, console: "Console"):
    """torchrun's DefaultLogsSpecs: each rank's stdout and stderr into files of their own under
    logs/torchrun/ (per attempt), here with each rank's error file at a stable path (an earlier
    attempt's removed: torchrun would read it as this one's) and the console following the files."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    from gridwright.runtime.jobdir import LOGS_DIR, TORCHRUN_LOGS_DIR, rank_error_file

    class RankLogs(DefaultLogsSpecs):
        def reify(self, envs):
            dest = super().reify(envs)
            ranks = {int(env["RANK"]): (local, dest.stdouts[local], dest.stderrs[local]) for local, env in envs.items()}
            attempt = next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0")
            console.follow(ranks, attempt)  # first: a restart's line names the last attempt's error
            for rank, (local, _, _) in ranks.items():
                error_file = rank_error_file(job_dir, rank)
                error_file.unlink(missing_ok=True)
                dest.error_files[local] = envs[local]["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            return dest

    return RankLogs(log_dir=str(job_dir / LOGS_DIR / TORCHRUN_LOGS_DIR), redirects=Std.ALL, tee=Std.NONE)


def _record_exits(job_dir: Path, node: int, failures: dict) -> None:
    """The exit code torchrun saw for each failed rank of this node, for the failure report
    (a rank killed by a signal leaves no error file)."""
    from gridwright.basics.atomic_io import write_text_atomic
    from gridwright.runtime.jobdir import node_exits_file

    codes = {str(rank): failure.exitcode for rank, failure in failures.items()}
    write_text_atomic(node_exits_file(job_dir, node), json.dumps({"node": node, "exitcodes": codes}))


class _LineFile:
    """A log file that several threads write to; closed, it takes nothing more (a log record
    at the agent's exit is lost rather than raised)."""

    def __init__(self, path: Path, first_line: str = ""):
        self._file = open(path, "w", encoding="utf-8", errors="replace", buffering=1)
        self._lock = threading.Lock()
        if first_line:
            self.write(first_line + "\n")

    def write(self, text: str) -> int:
        with self._lock:
            return 0 if self._file.closed else self._file.write(text)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Tee:
    """The agent's sys.stdout or sys.stderr: the terminal, with a copy in the node's log."""

    def __init__(self, terminal, log: _LineFile):
        self._terminal, self._log = terminal, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._terminal.write(text)

    def flush(self) -> None:
        self._terminal.flush()

    def __getattr__(self, name):
        return getattr(self._terminal, name)


class _RankStream:
    """One rank's stdout or stderr as torch's TailLog reads it from torchrun's file: each
    line to the rank's log, and to the terminal unless the rank marked it for its log only."""

    def __init__(self, log: _LineFile, terminal, terminal_lock: threading.Lock):
        from gridwright.launchers.failure_report import is_log_only

        self._log, self._terminal, self._lock, self._is_log_only = log, terminal, terminal_lock, is_log_only
        self._partial = ""  # TailLog hands on a line still being written in pieces
        self._hiding = False

    def write(self, text: str) -> None:
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            self._log.write(line + "\n")
            if self._is_log_only(line):
                self._hiding = True
            elif not (self._hiding and not line.strip()):  # torch's excepthook leaves blank lines unmarked
                self._hiding = False
                with self._lock:
                    self._terminal.write(line + "\n")
                    self._terminal.flush()

    def close(self) -> None:
        if self._partial:
            self.write("\n")


class Console:
    """Where this node's output goes (see the module's docstring for the files). The agent's
    own: the terminal and logs/node<K>.log. Each rank's: torchrun writes it into files
    (`_rank_logs`), which are followed here into logs/rank<N>.log and onto the terminal."""

    def __init__(self, job_dir: Path, node: int, torchrun_args: list[str]):
        from gridwright.runtime.jobdir import node_exits_file, node_log

        self.job_dir, self.node = job_dir, node
        path = node_log(job_dir, node)
        path.parent.mkdir(parents=True, exist_ok=True)
        node_exits_file(job_dir, node).unlink(missing_ok=True)  # an earlier run's
        started = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        self.log = _LineFile(path, f"# node {node}'s agent: pid {os.getpid()} on {socket.gethostname()}, started "
                                   f"{started}; torchrun {' '.join(torchrun_args)}")
        self.terminal = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.log), _Tee(sys.stderr, self.log)
        self._terminal_lock = threading.Lock()
        self._followed: list = []  # (TailLog, its _RankStream)
        self._rank_logs: list[_LineFile] = []
        self._attempt_started, self._attempt_dir = time.time(), None

    def keep_torch_logs_in_file(self) -> None:
        """torchrun's log records (the SIGTERMs it sends, each failed rank's exit code) go to
        the node's log only: on the terminal, the failure report says what they would."""
        import logging

        for name in ("torch", "torch.distributed"):
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, self.terminal[1]):
                    handler.setStream(self.log)

    def follow(self, ranks: dict[int, tuple[int, str, str]], attempt: str) -> None:
        """Follow one attempt's ranks (global rank -> local rank, stdout file, stderr file);
        a restart's attempt replaces the previous one's in logs/rank<N>.log."""
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog

        from gridwright.runtime.jobdir import rank_log

        if self._followed:  # torchrun restarts the workers (launcher.max_restarts): say why, in one line
            self.stop_following()
            self._note_restart(attempt)
        self._attempt_started = time.time()
        self._attempt_dir = Path(next(iter(ranks.values()))[1]).parents[1] if ranks else None  # torchrun's attempt_<A>
        started = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        for rank, (local, stdout, stderr) in sorted(ranks.items()):
            log = _LineFile(rank_log(self.job_dir, rank),
                            f"# rank {rank}: node {self.node}, local rank {local}, attempt {attempt}, "
                            f"started {started}; "
                            f"torchrun's copies: {Path(stdout).parent}")
            self._rank_logs.append(log)
            for path, terminal in ((stdout, self.terminal[0]), (stderr, self.terminal[1])):
                stream = _RankStream(log, terminal, self._terminal_lock)
                tail = TailLog(f"rank{rank}", {local: path}, stream, log_line_prefixes={local: ""}).start()
                self._followed.append((tail, stream))

    def _note_restart(self, attempt: str) -> None:
        from gridwright.launchers.failure_report import summarise

        first = summarise(self.job_dir, since=self._attempt_started).first
        why = f"after rank {first.rank} failed: {first.says()}" if first is not None and first.rank is not None else ""
        print(f"restart     torchrun starts the workers again (attempt {attempt}){' ' + why if why else ''}; "
              f"the last attempt's output is in {self._attempt_dir}", file=sys.stderr, flush=True)

    def stop_following(self) -> None:
        """Read the ranks' files to their end (the processes have ended) and close their logs."""
        for tail, stream in self._followed:
            tail.stop()
            stream.close()
        for log in self._rank_logs:
            log.close()
        self._followed, self._rank_logs = [], []

    def close(self) -> None:
        self.stop_following()
        sys.stdout, sys.stderr = self.terminal
        self.log.close()


def _start_watchdog(job_dir: Path, token: str, node: int, nodes: int):
    """The hang finder over this node's ranks (gridwright.launchers.watchdog), and, in a
    job of several nodes, over the other nodes' agents (gridwright.launchers.peer_agents)."""
    from gridwright.runtime.jobdir import load_job_config

    from .watchdog import Watchdog

    try:
        cfg = load_job_config(job_dir)
    except OSError:
        return None
    return Watchdog(job_dir, cfg, token, node=node, watch_peers=nodes > 1).start()


def nodes_of(torchrun_args: list[str]) -> int:
    """How many nodes the job has, from torchrun's `--nnodes` (N, or MIN:MAX: MAX)."""
    for i, arg in enumerate(torchrun_args):
        value = arg.split("=", 1)[1] if arg.startswith("--nnodes=") else (
            torchrun_args[i + 1] if arg == "--nnodes" and i + 1 < len(torchrun_args) else None)
        if value is not None:
            return int(value.split(":")[-1])
    return 1


def node_rank(torchrun_args: list[str]) -> int:
    """This node's rank among the job's nodes, from torchrun's options (0 when not given)."""
    for i, arg in enumerate(torchrun_args):
        for flag in ("--node_rank", "--node-rank"):
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
            if arg == flag and i + 1 < len(torchrun_args):
                return int(torchrun_args[i + 1])
    return 0


class JobRun:
    """The job's MLflow run, as node 0's agent owns it."""

    def __init__(self, cfg, job_dir: Path, run_id: str):
        self.cfg, self.job_dir, self.run_id = cfg, job_dir, run_id

    @classmethod
    def open(cls, job_dir: Path, torchrun_args: list[str]) -> "JobRun | None":
        """Open (or reopen) the run on node 0 with tracking on, and hand its id to the
        workers this agent starts; None elsewhere, or when the store cannot be reached
        (training goes on; the job directory keeps the record)."""
        from gridwright.runtime.jobdir import FAILURE_FILE, load_job_config

        try:
            cfg = load_job_config(job_dir)
        except OSError:
            return None
        if not cfg.tracking.enabled or node_rank(torchrun_args) != 0:
            return None
        from gridwright.tracking import mlflow_runs as tracking

        (job_dir / FAILURE_FILE).unlink(missing_ok=True)  # an earlier attempt's
        try:
            run_id = tracking.open_run(cfg, job_dir)
        except Exception as e:  # noqa: BLE001 - tracking never stops training
            print(tracking.tracking_failure_line("opening the run", tracking.one_line(e), job_dir), flush=True)
            return None
        os.environ["MLFLOW_RUN_ID"] = run_id
        os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri(cfg.tracking)
        print(f"mlflow      run {run_id} in {os.environ['MLFLOW_TRACKING_URI']}", flush=True)
        return cls(cfg, job_dir, run_id)

    def close(self, code: int, signum: int | None, since: float) -> None:
        """End the run as the job ended: killed (a stop by signal), finished, or failed
        with why (the watchdog's hang report, the logging rank's error, the exit code)."""
        from gridwright.runtime.jobdir import FAILURE_FILE, SUMMARY_FILE, read_json
        from gridwright.tracking import mlflow_runs as tracking

        from .peer_agents import loss_after
        from .watchdog import hang_summary

        stopped = signum or read_json(self.job_dir / SUMMARY_FILE).get("stopped_by_signal")
        status = "killed" if stopped else "finished" if code == 0 else "failed"
        error = None
        if status != "finished":
            error = (hang_summary(self.job_dir, since=since) or loss_after(self.job_dir, since=since)
                     or read_json(self.job_dir / FAILURE_FILE).get("error")
                     or f"the workers ended with exit code {code}")
        try:
            tracking.close_run(self.cfg.tracking, self.run_id, status, job_dir=self.job_dir, error=error)
            print("\n".join(tracking.where_to_see(tracking.tracking_uri(self.cfg.tracking), self.run_id)), flush=True)
        except Exception as e:  # noqa: BLE001 - a store out of reach must not hide the run's own exit
            print(tracking.tracking_failure_line("recording the run's end", tracking.one_line(e), self.job_dir),
                  flush=True)


if __name__ == "__main__":
    from gridwright.basics.process_exit import exit_without_final_collection

    exit_without_final_collection(main())
