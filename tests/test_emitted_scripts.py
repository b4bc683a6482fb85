"""The emitted Slurm script and torchrun lines with awkward paths: job directories and
interpreters holding spaces, unicode, quotes, `$`, `%`, `#`.

Golden files (tests/data/emitted_scripts/expected_*) hold the exact text for fixed inputs;
`GRIDWRIGHT_REGENERATE_GOLDEN=1 python -m pytest tests/test_emitted_scripts.py` rewrites
them (review the diff). The other tests read the emitted text back the way its readers
do: shlex, bash with stand-in Slurm commands, and a real local Slurm (sbatch)."""
from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from local_slurm import LocalSlurm, running_cluster

from gridwright.launchers import slurm as slurm_launcher
from gridwright.launchers import torchrun_multinode

GOLDEN = Path(__file__).parent / "data" / "emitted_scripts"
JOB_DIR = "/tmp/x/my jobs/ünï côde"
PYTHON = "/opt/my venv/bin/python"
# Each character here means something to bash or to sbatch's directive reader.
NASTY_DIRS = [
    JOB_DIR,
    "/tmp/x/it's \"quoted\" $HOME `id` 100% #1 & ; |",
    "/tmp/x/tab\there/ünï  two spaces/*?[a]",
]
SLURM_ARGS = ("launcher=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "launcher.partition=debug")


def hydra_quoted(key: str, value: str) -> str:
    """A Hydra override setting `key` to `value` exactly: single-quoted, `'` escaped. (Hydra
    keeps a backslash that precedes no quote as it is, so values here hold none.)"""
    assert "\\" not in value, value
    return f"{key}='" + value.replace("'", "\\'") + "'"


def config(compose, job_dir: str, *overrides):
    # launcher.python set: the text does not depend on the interpreter running the tests.
    return compose(*overrides, hydra_quoted("launcher.python", PYTHON), hydra_quoted("job_dir", job_dir))


def torchrun_text(cfg, job_dir: str, monkeypatch) -> str:
    """What emit_torchrun writes, without writing it (the golden job directory need not exist)."""
    written = {}
    monkeypatch.setattr(torchrun_multinode, "write_text_atomic", lambda path, text: written.setdefault(path, text))
    torchrun_multinode.emit_torchrun(cfg, Path(job_dir))
    return written[Path(job_dir) / torchrun_multinode.COMMANDS_FILE]


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("GRIDWRIGHT_REGENERATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing; GRIDWRIGHT_REGENERATE_GOLDEN=1 writes it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs; GRIDWRIGHT_REGENERATE_GOLDEN=1 rewrites it"


GOLDEN_SBATCH = {
    "expected_slurm_cpu.sbatch": SLURM_ARGS,
    "expected_slurm_cuda_container.sbatch": (
        "+experiment=llama3_8b", "launcher=slurm", "launcher.account=ml", hydra_quoted("name", "llama3 8b (ünï run)"),
        hydra_quoted("launcher.constraint", "a100|h100"), "launcher.container_image=nvcr.io/nvidia/pytorch:25.01-py3",
        "launcher.extra_directives=['--reservation=r1']", hydra_quoted("launcher.setup", "module load cuda"),
        hydra_quoted("+cluster.env.NCCL_IB_HCA", "mlx5_0,mlx5_1"), "+cluster.env.NCCL_SOCKET_IFNAME=ib0"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_SBATCH))
def test_sbatch_script_matches_golden(compose, name):
    cfg = config(compose, JOB_DIR, *GOLDEN_SBATCH[name])
    check_golden(name, slurm_launcher.sbatch_script(cfg, Path(JOB_DIR)))


def test_torchrun_commands_match_golden(compose, monkeypatch):
    cfg = config(compose, JOB_DIR, "+experiment=llama3_8b", "launcher=torchrun", "launcher.master_addr=10.0.0.1",
                 "+cluster.env.NCCL_SOCKET_IFNAME=eth0")
    check_golden("expected_torchrun_commands.sh", torchrun_text(cfg, JOB_DIR, monkeypatch))


def sbatch_words(rest: str) -> list[str]:
    """The words of an `#SBATCH` line after the keyword, as sbatch reads them (Slurm 22.05,
    src/sbatch/opt.c): split at whitespace; '...' and "..." group; a backslash escapes
    the next character; an unquoted `#` ends the line; nothing is expanded. A model for
    machines without Slurm; test_sbatch_accepts_the_script checks the real one."""
    words, word, quote, escaped = [], None, None, False
    for ch in rest:
        if escaped:
            word, escaped = (word or "") + ch, False
        elif ch == "\\":
            word, escaped = word or "", True
        elif quote:
            if ch == quote:
                quote = None
            else:
                word += ch
        elif ch in "'\"":
            word, quote = word or "", ch
        elif ch == "#":
            break
        elif ch.isspace():
            if word is not None:
                words.append(word)
            word = None
        else:
            word = (word or "") + ch
    assert quote is None, f"unmatched {quote} in {rest!r}"
    return words + ([word] if word is not None else [])


def directive_options(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            (word,) = sbatch_words(line[len("#SBATCH"):])  # one option per line
            key, _, value = word.partition("=")
            out[key] = value
    return out


def srun_agent_words(script: str) -> tuple[list[str], list[str]]:
    """The srun line's words, and the words of the agent command that its `bash -c` runs."""
    (line,) = [l for l in script.splitlines() if l.startswith("srun --kill-on-bad-exit")]
    words = shlex.split(line)
    assert words[-3:-1] == ["bash", "-c"]
    return words, shlex.split(words[-1])


@pytest.mark.parametrize("job_dir", NASTY_DIRS)
def test_sbatch_script_reads_back_intact(compose, job_dir):
    cfg = config(compose, job_dir, *SLURM_ARGS, hydra_quoted("name", "run #1 \"ünï\""),
                 "launcher.container_image=nvcr.io/nvidia/pytorch:25.01-py3")
    script = slurm_launcher.sbatch_script(cfg, Path(job_dir))
    options = directive_options(script)
    assert options["--output"] == job_dir.replace("%", "%%") + "/slurm-%j.out"
    assert options["--job-name"] == "run #1 \"ünï\"" and options["--partition"] == "debug"
    srun, agent = srun_agent_words(script)
    assert f"--output={job_dir.replace('%', '%%')}/slurm-%j-node%n.out" in srun
    assert f"--container-mounts={job_dir}:{job_dir}" in srun
    # The node's numbers stay variables for the inner bash (one per node), not the script's.
    assert agent == [PYTHON, "-m", "gridwright.launchers.agent", "--job-dir", job_dir, "--nnodes=$SLURM_NNODES",
                     "--nproc_per_node=1", "--node_rank=$SLURM_NODEID", "--master_addr=$MASTER_ADDR",
                     "--master_port=$MASTER_PORT"]
    (export,) = [l for l in script.splitlines() if l.startswith("export GRIDWRIGHT_PLACEMENT=")]
    assert shlex.split(export) == ["export", f"GRIDWRIGHT_PLACEMENT={job_dir}/placement.json"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("job_dir", NASTY_DIRS)
def test_torchrun_line_reads_back_intact(compose, job_dir, monkeypatch):
    cfg = config(compose, job_dir, "launcher=torchrun", "cluster.nodes=2", "cluster.gpus_per_node=1")
    lines = [l for l in torchrun_text(cfg, job_dir, monkeypatch).splitlines() if l and not l.startswith("#")]
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        words = shlex.split(line)
        assert words[:4] == ["DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1", PYTHON]
        assert words[4:8] == ["-m", "gridwright.launchers.agent", "--job-dir", job_dir]
        assert f"--node_rank={rank}" in words


def write_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# Stands in for the interpreter: records its arguments (NUL-separated) and its placement
# file in the job directory it is given, one file per node.
FAKE_PYTHON = """#!/bin/bash
set -eu
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[i]}" = --job-dir ] && dir=${args[i+1]}; done
printf '%s\\0' "$0" "$@" "$GRIDWRIGHT_PLACEMENT" > "$dir/argv-node${SLURM_NODEID:-x}"
echo "fake python ran"
"""


def recorded(job_dir: Path, node) -> list[str]:
    return (job_dir / f"argv-node{node}").read_text().split("\0")[:-1]


def expected_argv(python: Path, job_dir: Path, nnodes, node_rank, master_addr, master_port) -> list[str]:
    return [str(python), "-m", "gridwright.launchers.agent", "--job-dir", str(job_dir), f"--nnodes={nnodes}",
            "--nproc_per_node=1", f"--node_rank={node_rank}", f"--master_addr={master_addr}",
            f"--master_port={master_port}", f"{job_dir}/placement.json"]


def awkward_paths(tmp_path: Path) -> tuple[Path, Path]:
    """A job directory and an interpreter with awkward names, both real."""
    job_dir = tmp_path / "my jobs" / "ünï côde" / "it's \"100%\" #1 $HOME"
    job_dir.mkdir(parents=True)
    return job_dir, write_executable(tmp_path / "my venv ünï" / "bin" / "python", FAKE_PYTHON)


def test_torchrun_line_runs_under_bash(compose, tmp_path, monkeypatch):
    job_dir, python = awkward_paths(tmp_path)
    cfg = compose("launcher=torchrun", "cluster.nodes=2", "cluster.gpus_per_node=1",
                  hydra_quoted("launcher.python", str(python)))
    lines = [l for l in torchrun_text(cfg, str(job_dir), monkeypatch).splitlines() if l and not l.startswith("#")]
    result = subprocess.run(["bash", "-c", lines[1]], env={"PATH": "/usr/bin:/bin", "SLURM_NODEID": "1",
                            "GRIDWRIGHT_PLACEMENT": f"{job_dir}/placement.json"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert recorded(job_dir, 1) == expected_argv(python, job_dir, 2, 1, "node0", 29500)


# Stand-ins for Slurm's commands: the script's body runs under bash as on a node.
FAKE_SLURM = {
    "scontrol": "#!/bin/bash\nprintf 'n1\\nn2\\n'\n",
    "hostname": "#!/bin/bash\necho '10.1.2.3 fe80::1'\n",
    # srun: drop the options (recording --output), run the command as node 1 would.
    "srun": """#!/bin/bash
for a in "$@"; do case "$a" in --output=*) printf '%s' "${a#--output=}" > "$FAKE_SLURM_LOG";; esac; done
while [ $# -gt 0 ]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done
SLURM_NODEID=1 exec "$@"
""",
}


def test_sbatch_body_runs_under_bash(compose, tmp_path):
    job_dir, python = awkward_paths(tmp_path)
    for name, text in FAKE_SLURM.items():
        write_executable(tmp_path / "fake slurm" / name, text)
    cfg = compose(*SLURM_ARGS, hydra_quoted("launcher.python", str(python)))
    script = write_executable(tmp_path / "job.sbatch", slurm_launcher.sbatch_script(cfg, job_dir))
    env = {"PATH": f"{tmp_path / 'fake slurm'}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NNODES": "2", "FAKE_SLURM_LOG": str(tmp_path / "srun-output")}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "fake python ran" in result.stdout and "head n1 (10.1.2.3:29500)" in result.stdout
    assert recorded(job_dir, 1) == expected_argv(python, job_dir, 2, 1, "10.1.2.3", 29500)
    assert (tmp_path / "srun-output").read_text() == f"{str(job_dir).replace('%', '%%')}/slurm-%j-node%n.out"


@pytest.mark.parametrize("override, job_dir, message", [
    (None, "/tmp/x/two\nlines", "job_dir=.*line break"),
    (None, "/tmp/x/back\\slash", "job_dir=.*backslash"),
    (hydra_quoted("launcher.partition", "gpu\n#SBATCH --qos=high"), JOB_DIR, "launcher.partition=.*line break"),
    ("launcher.extra_directives=['--reservation=r1\n--qos=high']", JOB_DIR, "launcher.extra_directives.*line break"),
])
def test_sbatch_refuses_what_it_cannot_write(compose, override, job_dir, message):
    cfg = compose(*SLURM_ARGS, *([override] if override else []))
    with pytest.raises(ValueError, match=message):
        slurm_launcher.sbatch_script(cfg, Path(job_dir))


def test_container_mounts_refuse_a_colon_or_comma(compose):
    cfg = compose(*SLURM_ARGS, "launcher.container_image=img")
    for job_dir in ("/tmp/a:b", "/tmp/a,b"):
        with pytest.raises(ValueError, match="job_dir=.*container-mounts"):
            slurm_launcher.sbatch_script(cfg, Path(job_dir))


@pytest.fixture(scope="module")
def local_slurm():
    """The local two-node Slurm of tests/local_slurm.py (as tests/test_multinode.py uses it)."""
    with running_cluster() as cluster:
        yield cluster


def job_fields(slurm: LocalSlurm, job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields that sit last on their line (JobName, StdOut), whole:
    their values may hold spaces."""
    out = {}
    for line in slurm.scontrol("show", "job", job_id).splitlines():
        for key in ("JobName", "StdOut"):
            if f" {key}=" in f" {line.strip()}":
                out[key] = line.split(f"{key}=", 1)[1]
    return out


@pytest.mark.parametrize("job_dir", NASTY_DIRS)
def test_sbatch_accepts_the_script(compose, local_slurm, job_dir):
    """`sbatch --test-only`: sbatch parses the directives and the controller checks the job.
    Then submitted on hold: the controller holds the job name and output file meant."""
    cfg = config(compose, job_dir, *SLURM_ARGS, hydra_quoted("name", "run #1 \"ünï\""))
    script = Path(tempfile.mkdtemp(prefix="gridwright-sbatch-")) / "job.sbatch"
    try:
        script.write_text(slurm_launcher.sbatch_script(cfg, Path(job_dir)))
        result = subprocess.run(["sbatch", "--test-only", str(script)], env=local_slurm.env,
                                capture_output=True, text=True)
        assert result.returncode == 0 and "to start at" in result.stderr, result.stderr
        job_id = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], env=local_slurm.env,
                                capture_output=True, text=True, check=True).stdout.strip()
        try:
            # scontrol shows %j expanded, and a doubled % as written (slurmstepd undoubles it).
            assert job_fields(local_slurm, job_id) == {
                "JobName": "run #1 \"ünï\"", "StdOut": f"{job_dir.replace('%', '%%')}/slurm-{job_id}.out"}
        finally:
            subprocess.run(["scancel", job_id], env=local_slurm.env, check=True)
    finally:
        shutil.rmtree(script.parent)


def test_sbatch_runs_the_script_on_two_nodes(compose, local_slurm, tmp_path):
    """Submitted unedited: both output patterns land in the job directory and each node's
    interpreter (a stand-in) gets the job directory intact and its own node rank."""
    job_dir, python = awkward_paths(tmp_path)
    cfg = compose(*SLURM_ARGS, hydra_quoted("launcher.python", str(python)), "launcher.master_port=29555")
    script = write_executable(job_dir / "job.sbatch", slurm_launcher.sbatch_script(cfg, job_dir))
    job_id = local_slurm.sbatch(script)
    state = local_slurm.wait(job_id, timeout=120)
    logs = "".join(p.read_text() for p in sorted(job_dir.glob("slurm-*.out")))
    assert state == "COMPLETED", logs
    assert sorted(p.name for p in job_dir.glob("slurm-*.out")) == [
        f"slurm-{job_id}-node0.out", f"slurm-{job_id}-node1.out", f"slurm-{job_id}.out"]
    assert "0: fake python ran" in (job_dir / f"slurm-{job_id}-node0.out").read_text()
    for node in (0, 1):
        argv = recorded(job_dir, node)
        master_addr = argv[8].split("=", 1)[1]
        assert argv == expected_argv(python, job_dir, 2, node, master_addr, 29555)
