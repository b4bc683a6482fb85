"""The per-node agent of every launcher: torchrun, wrapped so that a run ends whole.

    python -m gridwright.launchers.agent --job-dir DIR [torchrun options]

runs torchrun's agent in this process with `-m gridwright.runtime.worker --job-dir DIR` as the
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
  to close (gridwright.tracking.run_owner).
"""
from __future__ import annotations

import datetime
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
        from torch.distributed.run import main as torchrun_main

        _register_loopback_backend()
        watchdog = _start_watchdog(job_dir, token)
        try:
            torchrun_main([*torchrun_args, "-m", "gridwright.runtime.worker", "--job-dir", str(job_dir)])
            code = 0
        except ChildFailedError as e:  # a worker that refused its input (exit 2) has said why in one line;
            code = 2 if e.get_first_failure()[1].exitcode == 2 else 1  # torchrun then ended the others
        except SignalException as e:
            stopped_by["signal"] = int(e.sigval)
            code = 128 + int(e.sigval)
        finally:
            if watchdog is not None:
                watchdog.stop()
    except KeyboardInterrupt:
        code = 128 + stopped_by.get("signal", signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the clean-up below
        left = end_run_processes(token)
        if left:
            print(f"agent       ended {left} process(es) the workers left behind", file=sys.stderr, flush=True)
        if run is not None:
            run.close(code, stopped_by.get("signal"), since=started)
    return code


def _start_watchdog(job_dir: Path, token: str):
    """The hang finder over this node's ranks (gridwright.launchers.watchdog)."""
    from gridwright.runtime.jobdir import load_job_config

    from .watchdog import Watchdog

    try:
        cfg = load_job_config(job_dir)
    except OSError:
        return None
    return Watchdog(job_dir, cfg, token).start()


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

        from .watchdog import hang_summary

        stopped = signum or read_json(self.job_dir / SUMMARY_FILE).get("stopped_by_signal")
        status = "killed" if stopped else "finished" if code == 0 else "failed"
        error = None
        if status != "finished":
            error = (hang_summary(self.job_dir, since=since) or read_json(self.job_dir / FAILURE_FILE).get("error")
                     or f"the workers ended with exit code {code}")
        try:
            tracking.close_run(self.cfg.tracking, self.run_id, status, job_dir=self.job_dir, error=error)
            print("\n".join(tracking.where_to_see(tracking.tracking_uri(self.cfg.tracking), self.run_id)), flush=True)
        except Exception as e:  # noqa: BLE001 - a store out of reach must not hide the run's own exit
            print(tracking.tracking_failure_line("recording the run's end", tracking.one_line(e), self.job_dir),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
