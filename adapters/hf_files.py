"""Hugging Face model folders: sharded safetensors in, sharded safetensors out.

Reading goes through `safetensors.safe_open`, one tensor at a time (memory-mapped, so
only the tensor asked for is read). Writing streams one tensor at a time too (see
StreamingSafetensorsWriter for why it is not `safetensors.torch.save_file`).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..basics.path_rules import PathRefused, model_folder_file, read_bounded_text

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
INDEX_BYTES = 64 << 20  # an index of a few hundred thousand tensor names
# Files copied along with the weights (tokenizer and generation settings), when present.
SIDE_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


class BadCheckpoint(ValueError):
    """The source is missing, corrupt or inconsistent; nothing was written."""


class SafetensorsSource:
    """The tensors of a Hugging Face folder, by name, read lazily."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX
        if os.path.lexists(index):
            try:
                weight_map = json.loads(read_bounded_text(self._checked(INDEX), INDEX_BYTES, "a safetensors index",
                                                          follow=True))
                weight_map = weight_map["weight_map"]
                assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
            except PathRefused as e:
                raise BadCheckpoint(str(e)) from None
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
                raise BadCheckpoint(f"{index} is not a safetensors index ({type(e).__name__}).") from None
        elif os.path.lexists(self.dir / SINGLE):
            weight_map = None
        else:
            raise BadCheckpoint(f"{self.dir} holds neither {INDEX} nor {SINGLE} (only safetensors convert).")
        self.files: dict[str, str] = {}  # tensor name -> file name
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, shape)
        for fname in sorted(set(weight_map.values())) if weight_map else [SINGLE]:
            for name, info in self._header(fname).items():
                if name in self.files:
                    raise BadCheckpoint(f"{name} is stored twice, in {self.files[name]} and {fname}.")
                self.files[name] = fname
                self.meta[name] = info
        if weight_map:
            listed, found = set(weight_map), set(self.files)
            misplaced = sorted(n for n in listed & found if weight_map[n] != self.files[n])
            if listed != found or misplaced:
                raise BadCheckpoint(
                    f"{index} and the shard files disagree: listed but absent {sorted(listed - found)[:5]}, "
                    f"present but unlisted {sorted(found - listed)[:5]}, in another file than listed {misplaced[:5]}."
                )

    def _checked(self, fname: str) -> Path:
        """`fname` of this folder as a path that may be read (path_rules.model_folder_file)."""
        try:
            return model_folder_file(self.dir, fname)
        except FileNotFoundError:
            raise BadCheckpoint(f"{self.dir / fname} is listed in the index but does not exist.") from None
        except PathRefused as e:
            raise BadCheckpoint(f"{e}.") from None

    def _header(self, fname: str) -> dict:
        path = self._checked(fname)
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise BadCheckpoint(f"{path} is not a readable safetensors file ({e}).") from e

    def size_disagreements(self, config: dict) -> list[str]:
        """The model sizes of a config.json that the files contradict (layers, hidden size,
        vocabulary, heads), read from the headers alone: a config asking for 10^6 layers or
        10^9 hidden units is refused in a second, before transformers or any allocation."""
        out = []
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                    "intermediate_size", "head_dim"):
            value = config.get(key)
            if value is not None and (type(value) is not int or value < 1):
                out.append(f"{key}={value!r} is not a positive whole number")
        if out:
            return out
        layers = {int(m.group(1)) for n in self.files if (m := re.search(r"\.layers\.(\d+)\.", n))}
        if config.get("num_hidden_layers") is not None and config["num_hidden_layers"] != len(layers):
            out.append(f"num_hidden_layers={config['num_hidden_layers']} (the files hold {len(layers)} layers)")
        embed = next((n for n in sorted(self.files) if n.endswith("embed_tokens.weight")), None)
        if embed and len(self.meta[embed][1]) == 2:
            vocab, hidden = self.meta[embed][1]
            for key, held in (("hidden_size", hidden), ("vocab_size", vocab)):
                if config.get(key) is not None and config[key] != held:
                    out.append(f"{key}={config[key]} (the embedding holds {held})")
        query = next((n for n in sorted(self.files) if n.endswith("layers.0.self_attn.q_proj.weight")), None)
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        if query and heads and hidden and not out:
            head_dim = config.get("head_dim") or hidden // heads
            if heads * head_dim != self.meta[query][1][0]:
                out.append(f"num_attention_heads={heads} x head_dim {head_dim} = {heads * head_dim} "
                           f"(the query projection holds {self.meta[query][1][0]} rows)")
        return out

    def names(self) -> set[str]:
        return set(self.files)

    def _read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Open, read, close: a file stays memory-mapped only while one tensor is read, so
        the mapped pages of a multi-GB shard never add up in this process's memory."""
        path = self.dir / self.files[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0]:rows[1]]
                return t.clone()  # own memory, not pages of the mapping
        except (SafetensorError, OSError, RuntimeError) as e:
            raise BadCheckpoint(f"{path}: cannot read {name} ({e}).") from e

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor, reading only those (embeddings are large)."""
        return self._read(name, (start, stop))

    def total_bytes(self) -> int:
        return sum((self.dir / f).stat().st_size for f in set(self.files.values()))


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class StreamingSafetensorsWriter:
    """Writes planned tensors one at a time into shards of at most `max_shard_bytes`.

    Hand-written rather than `safetensors.torch.save_file`, which needs a whole shard in
    memory and then copies it to bytes (two shards' worth at the peak). The safetensors
    format is small and fixed: an 8-byte little-endian header length, a JSON header of
    name -> dtype, shape and byte range, then the raw little-endian bytes. Every tensor's
    name, shape and dtype is known before conversion starts, so each shard's header is
    written first and the data streams behind it. Files are read back by `safe_open` in
    the tests (and by transformers).
    """

    def __init__(self, out_dir: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.dir = out_dir
        self.shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        for name, shape, dtype in entries:
            nbytes = dtype.itemsize
            for dim in shape:
                nbytes *= dim
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self.total = sum(e[3] for shard in self.shards for e in shard)
        self.files = [f"model-{i:05d}-of-{len(self.shards):05d}.safetensors" for i in range(1, len(self.shards) + 1)]
        self._shard, self._pos, self._rows, self._stream = 0, 0, 0, None

    def _open_next(self) -> None:
        entries = self.shards[self._shard]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, nbytes in entries:
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
        self._stream = open(self.dir / self.files[self._shard], "wb")
        self._stream.write(len(text).to_bytes(8, "little") + text)
        self._pos = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The next planned tensor, whole or as its next block of rows."""
        if self._stream is None:
            self._open_next()
        want, shape, dtype, _ = self.shards[self._shard][self._pos]
        fits = (name == want and tensor.dtype == dtype and tuple(tensor.shape[1:]) == shape[1:]
                and self._rows + tensor.shape[0] <= shape[0])
        if not fits:
            raise ValueError(f"writer expected {want} {shape} {dtype} (from row {self._rows}), "
                             f"got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self._stream.write(tensor.contiguous().view(torch.uint8).numpy().data)  # x86/ARM: little-endian
        self._rows += tensor.shape[0]
        if self._rows < shape[0]:
            return
        self._pos, self._rows = self._pos + 1, 0
        if self._pos == len(self.shards[self._shard]):
            self._stream.close()
            self._stream, self._shard = None, self._shard + 1

    def finish(self) -> None:
        """Check every planned tensor was written, then write the index transformers reads."""
        if self._shard != len(self.shards) or self._stream is not None:
            raise ValueError("not every planned tensor was written")
        weight_map = {e[0]: f for f, shard in zip(self.files, self.shards) for e in shard}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
