"""Untrusted checkpoints never run code: a payload planted in each pickled file of a real
Megatron-Core and DeepSpeed checkpoint never runs on any path that reads it (pre-start
check, the workers' resume, every conversion), and each path refuses in one line, exit 2.
Each payload is live (unpickled as upstream would, it runs; the trust switch runs the one
inside a shard), and the switch loads a real checkpoint of one's own."""
from __future__ import annotations

import importlib
import io
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_payloads import (
    Payload,
    env_without_mlflow,
    latest,
    plant_in_dcp_metadata,
    plant_in_dcp_shard,
    plant_in_te_extra_state,
    plant_in_torch_file,
)
from conftest import REPO, run_torchrun_job

from gridwright.checkpoints.checkpoint_trust import (
    CITED,
    UntrustedCheckpointFile,
    load_torch_file,
    read_dcp_metadata,
)


def run(args: list[str], cwd: Path, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env_without_mlflow(), capture_output=True, text=True, timeout=timeout)


def launch(tmp: Path, *args) -> subprocess.CompletedProcess:
    return run([sys.executable, str(REPO / "launch.py"), "tracking=off", f"job_root={tmp / 'jobs'}",
                "train.warmup_steps=1", *args], tmp)


def convert(tmp: Path, *args) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "gridwright.adapters.convert", *args], tmp)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One real checkpoint of each kind: Megatron-Core, DeepSpeed without ZeRO, ZeRO-3."""
    tmp = tmp_path_factory.mktemp("saved")
    out = {}
    for name, args in {"megatron": [], "zero0": ["engine=deepspeed", "zero=stage0"],
                       "zero3": ["engine=deepspeed", "zero=stage3"]}.items():
        result = launch(tmp, *args, "train.steps=2", f"checkpoint.save={tmp / name}", f"job_dir={tmp / ('job_' + name)}")
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = tmp / name
    return out


# The torch files planted in, by plant.
TORCH_FILES = {"megatron common.pt": "common.pt", "zero0 model states": "mp_rank_00_model_states.pt",
               "zero3 optimizer states": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
               "zero3 model states": "zero_pp_rank_0_mp_rank_00_model_states.pt"}
PLANTS = {
    "megatron common.pt": ("megatron", lambda it, m: plant_in_torch_file(it / "common.pt", m)),
    "megatron .metadata": ("megatron", plant_in_dcp_metadata),
    "megatron .distcp object": ("megatron", plant_in_dcp_shard),
    # Transformer Engine's FP8 extra state: a pickle inside the uint8 tensor of a .distcp object
    "megatron TE extra state": ("megatron", plant_in_te_extra_state),
    "zero0 model states": ("zero0", lambda it, m: plant_in_torch_file(it / "mp_rank_00_model_states.pt", m)),
    "zero3 optimizer states": ("zero3", lambda it, m: plant_in_torch_file(
        it / "zero_pp_rank_1_mp_rank_00_optim_states.pt", m)),
    "zero3 model states": ("zero3", lambda it, m: plant_in_torch_file(
        it / "zero_pp_rank_0_mp_rank_00_model_states.pt", m)),
}


def refused_in_one_line(result, file_part: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if "could run code: refused" in l]
    assert len(lines) == 1 and file_part in lines[0] and "checkpoint.trust_pickled_code=true" in lines[0], \
        result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_payload_never_runs_and_each_reader_refuses(plant, saved, tmp_path):
    kind, put = PLANTS[plant]
    ck, marker = tmp_path / "ck", tmp_path / "marker"
    shutil.copytree(saved[kind], ck)
    put(latest(ck), marker)
    planted = {"megatron common.pt": "common.pt", "megatron .metadata": ".metadata",
               "megatron .distcp object": ".distcp", "megatron TE extra state": "Transformer Engine extra state",
               "zero0 model states": "mp_rank_00_model_states.pt",
               "zero3 optimizer states": "optim_states.pt", "zero3 model states": "model_states.pt"}[plant]
    engine = [] if kind == "megatron" else ["engine=deepspeed", f"zero=stage{kind[-1]}"]

    # The pre-start check of a local launch: nothing is started.
    refused_in_one_line(launch(tmp_path, *engine, "train.steps=4", f"checkpoint.load={ck}"), planted)
    assert not (tmp_path / "jobs").exists()
    # The workers' own load (a torchrun job: no pre-start check on the launching machine).
    refused_in_one_line(run_torchrun_job(tmp_path, *engine, "train.steps=4", f"checkpoint.load={ck}"), planted)
    # Every conversion that reads this kind of checkpoint.
    if kind == "megatron":
        directions = [["megatron-to-hf", "--megatron", str(ck)]]
    else:
        directions = [["deepspeed-to-hf", "--deepspeed", str(ck)], ["deepspeed-to-megatron", "--deepspeed", str(ck)]]
    for i, direction in enumerate(directions):
        refused_in_one_line(convert(tmp_path, *direction, "--out", str(tmp_path / f"out{i}")), planted)
        assert not (tmp_path / f"out{i}").exists()
    assert not marker.exists(), f"the payload in the {plant} ran"
    if kind == "megatron" and "TE" in plant:
        # Live: unpickled as TE would unpickle it (the torch-native layers never read it)
        pickle.loads(te_payload(ck))
        assert marker.exists(), "the planted TE extra state did not run when unpickled: the test proves nothing"
        return
    # The payload is live: unpickled as an upstream reader would (the planted file itself),
    # or, for an object inside a shard, by a resume that trusts the checkpoint.
    if plant == "megatron .distcp object":
        launch(tmp_path, *engine, "train.steps=3", f"checkpoint.load={ck}", "checkpoint.trust_pickled_code=true")
    elif plant == "megatron .metadata":
        with open(latest(ck) / ".metadata", "rb") as f:
            pickle.load(f)
    else:
        torch.load(latest(ck) / TORCH_FILES[plant], map_location="cpu", weights_only=False)
    assert marker.exists(), "the planted payload did not run when unpickled: the test proves nothing"


def te_payload(ck: Path) -> bytes:
    """The planted extra state's pickle, read back as TE reads the object (a uint8 tensor)."""
    from gridwright.checkpoints.checkpoint_trust import dcp_objects

    objects = {fqn: value for fqn, _, value in dcp_objects(latest(ck))}
    return objects["decoder.layers.self_attention.linear_proj._extra_state/shard_0_4"].numpy().tobytes()


@pytest.mark.slow
def test_trusting_ones_own_checkpoint_still_resumes(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved["megatron"], ck)
    result = launch(tmp_path, "train.steps=4", f"checkpoint.load={ck}", "checkpoint.trust_pickled_code=true",
                    f"job_dir={tmp_path / 'job'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming after step 2" in result.stdout


@pytest.mark.slow  # reads the checkpoint a training run saves (the module's fixture)
def test_the_metadata_reader_admits_torchs_records_and_nothing_else(saved, tmp_path):
    it = latest(saved["megatron"])
    index = read_dcp_metadata(it)
    with open(it / ".metadata", "rb") as f:
        assert index.state_dict_metadata == pickle.load(f).state_dict_metadata
    evil = tmp_path / "iter_0000001"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "marker", index)))
    with pytest.raises(UntrustedCheckpointFile, match=r"needs builtins\.eval"):
        read_dcp_metadata(evil)
    assert not (tmp_path / "marker").exists()


@pytest.mark.slow
def test_guarded_torch_load_overrides_a_callers_weights_only_false(tmp_path):
    """What DeepSpeed's and DCP's own loaders ask for (weights_only=False) is refused once
    the process is guarded; tensors still load."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(3.0), "x": Payload(tmp_path / "marker", 1)}, buffer)
    clean = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, clean)
    code = ("import io, sys, torch; from gridwright.checkpoints.checkpoint_trust import guard_process; guard_process(); "
            "data = sys.stdin.buffer.read(); n = int(sys.argv[1]); "
            "print(torch.load(io.BytesIO(data[:n]), weights_only=False)['w'].tolist()); "
            "torch.load(io.BytesIO(data[n:]), weights_only=False)")
    done = subprocess.run([sys.executable, "-c", code, str(len(clean.getvalue()))], cwd=REPO,
                          input=clean.getvalue() + buffer.getvalue(), capture_output=True)
    assert done.stdout.decode().strip() == "[0.0, 1.0, 2.0]", done.stderr.decode()[-2000:]
    assert b"UntrustedCheckpointFile" in done.stderr and b"needs eval" in done.stderr
    assert not (tmp_path / "marker").exists()
    assert load_torch_file(io.BytesIO(clean.getvalue()))["w"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("package, file, line", CITED)
def test_the_upstream_readers_the_guard_stands_in_for_are_as_cited(package, file, line):
    """Each upstream reader guard_process covers still reads as cited (an upgrade that
    changes one fails here, and the guard must be checked against the new code)."""
    root = Path(importlib.import_module(package).__file__).parent
    assert line in (root / file).read_text(), f"{package}/{file} no longer holds: {line}"
