"""A real Slurm on this host for the tests: munge, slurmctld and two slurmd (nodes n1, n2),
all under one temporary directory, on free ports (slurmd -N names each node).

Needs root (slurmd runs jobs as their user) and Slurm from the distribution's packages
(`.ci/run` installs them when missing)."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextlib.contextmanager
def running_cluster():
    """A started two-node LocalSlurm for a test module's fixture (skipped where Slurm is
    missing), stopped and removed afterwards."""
    import tempfile

    import pytest

    why = missing()
    if why:
        pytest.skip(f"no local Slurm: {why}")
    # Not under pytest's 0700 temporary root: munged runs as its own user and must reach it.
    root = Path(tempfile.mkdtemp(prefix="gridwright-slurm-", dir="/tmp"))
    cluster = LocalSlurm(root).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def missing() -> str | None:
    """Why a local Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (apt-get install slurm-wlm)"
    return None


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "etc" / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _run(self, *cmd, **kw):
        return subprocess.run(list(cmd), env=self.env, check=True, capture_output=True, text=True, **kw)

    def start(self) -> "LocalSlurm":
        r = self.root
        for d in ("munge", "munge-run", "etc", "state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(r / "munge", "munge", "munge")
        shutil.chown(r / "munge-run", "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(r / "munge", 0o700)
        os.chmod(key, 0o400)
        os.chmod(r / "munge-run", 0o755)
        os.chmod(r, 0o755)
        sock = r / "munge-run" / "munge.socket.2"
        self._run("runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={sock}", f"--key-file={key}",
                  f"--log-file={r}/munge/munged.log", f"--pid-file={r}/munge-run/munged.pid",
                  f"--seed-file={r}/munge/munged.seed")
        ctl, node, n1, n2 = _free_ports(4)
        host = socket.gethostname()
        (r / "etc" / "plugstack.conf").write_text("")
        self.conf.write_text(f"""ClusterName=gwtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctl}
SlurmdPort={node}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
PlugStackConfig={r}/etc/plugstack.conf
KillWait=30
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs=2 RealMemory=10000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2} CPUs=2 RealMemory=10000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")
        self._run("slurmctld", "-f", str(self.conf))
        self._run("slurmd", "-f", str(self.conf), "-N", "n1")
        self._run("slurmd", "-f", str(self.conf), "-N", "n2")
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t %D"], env=self.env, capture_output=True, text=True).stdout
            if out.split() == ["idle", "2"]:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the local Slurm did not come up: {out!r}; logs in {r}/log")

    def sbatch(self, script: Path, clean_env: bool = True) -> str:
        """Submit unedited; with `clean_env`, from an environment with only a system PATH
        (the interpreter must come from the script, not from the caller's PATH)."""
        env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(self.conf), "HOME": "/root"} if clean_env else self.env
        out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True,
                             check=True).stdout
        return out.strip().split(";")[0]

    def state(self, job_id: str) -> str:
        out = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def wait(self, job_id: str, timeout: float = 600) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.state(job_id)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"):
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {self.state(job_id)} after {timeout} s")

    def scontrol(self, *args) -> str:
        return self._run("scontrol", *args).stdout

    def stop(self) -> None:
        for pid_file in ("slurmd-n1.pid", "slurmd-n2.pid", "slurmctld.pid"):
            path = self.root / "run" / pid_file
            if path.exists():
                subprocess.run(["kill", path.read_text().strip()], capture_output=True)
        time.sleep(1)
        path = self.root / "munge-run" / "munged.pid"
        if path.exists():
            subprocess.run(["kill", path.read_text().strip()], capture_output=True)
