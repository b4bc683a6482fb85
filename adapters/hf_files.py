"""Hugging Face model folders: sharded safetensors in, sharded safetensors out.

Reading goes through `safetensors.safe_open`, one tensor at a time (memory-mapped, so
only the tensor asked for is read). Writing uses `safetensors.torch.save_file` per shard:
a shard is held in memory until written, which is what bounds the peak memory of the
Megatron -> Hugging Face direction (`max_shard_bytes`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files copied along with the weights (tokenizer and generation settings), when present.
SIDE_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "merges.txt",
)


class BadCheckpoint(ValueError):
    """The source is missing, corrupt or inconsistent; nothing was written."""


class SafetensorsSource:
    """The tensors of a Hugging Face folder, by name, read lazily."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise BadCheckpoint(f"{index} is not a safetensors index ({e}).") from e
        elif (self.dir / SINGLE).is_file():
            weight_map = None
        else:
            raise BadCheckpoint(f"{self.dir} holds neither {INDEX} nor {SINGLE} (only safetensors convert).")
        self.files: dict[str, str] = {}  # tensor name -> file name
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, shape)
        for fname in sorted(set(weight_map.values())) if weight_map else [SINGLE]:
            for name, info in self._header(fname).items():
                self.files[name] = fname
                self.meta[name] = info
        if weight_map:
            listed, found = set(weight_map), set(self.files)
            if listed != found:
                raise BadCheckpoint(
                    f"{index} and the shard files disagree: listed but absent {sorted(listed - found)[:5]}, "
                    f"present but unlisted {sorted(found - listed)[:5]}."
                )
        self._handles: dict[str, object] = {}

    def _header(self, fname: str) -> dict:
        path = self.dir / fname
        if not path.is_file():
            raise BadCheckpoint(f"{path} is listed in the index but does not exist.")
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise BadCheckpoint(f"{path} is not a readable safetensors file ({e}).") from e

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        fname = self.files[name]
        if fname not in self._handles:
            self._handles.clear()  # one open file at a time: keeps mapped pages bounded
            self._handles[fname] = safe_open(str(self.dir / fname), framework="pt")
        try:
            return self._handles[fname].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise BadCheckpoint(f"{self.dir / fname}: cannot read {name} ({e}).") from e

    def total_bytes(self) -> int:
        return sum((self.dir / f).stat().st_size for f in set(self.files.values()))


class ShardedSafetensorsWriter:
    """Writes tensors in order into shards of at most `max_shard_bytes`, then the index."""

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.dir, self.max = out_dir, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        number = len(self.shards) + 1
        save_file(self.pending, str(self.dir / f"shard-{number:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards as transformers does (model-0000i-of-0000n) and write the index."""
        if self.pending:
            self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.dir / f"shard-{i:05d}.safetensors").rename(self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
