"""Megatron-Core distributed checkpoints (torch_dist format), written and read piece by piece.

The format is torch.distributed.checkpoint (DCP) plus two small files Megatron-Core adds
(`metadata.json` naming the backend, `common.pt` with non-tensor state). Megatron-Core's
own `dist_checkpointing.save` needs every tensor in memory at once; for a 16 GB model on
a 24 GB machine that is not streaming, so the writer here plans DCP items itself and
produces each tensor only when DCP's file writer asks for it (SavePlanner.resolve_data),
one at a time. The reader does the reverse with a LoadPlanner that asks for one slice
(a layer, an expert) at a time. Both use DCP's documented planner protocol; the files
are what Megatron-Core's loader reads (tested by loading them into GPTModel at several
layouts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..checkpoints.checkpoint_dir import CheckpointError, latest_checkpoint, read_common
from ..checkpoints.checkpoint_trust import read_dcp_metadata, refuse_pickled_code

class NotAMegatronCheckpoint(ValueError):
    """Bad input: the path holds no Megatron-Core checkpoint."""


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(root, iteration directory) from either a checkpoint root (with `latest`) or one iteration."""
    if (path / "metadata.json").is_file():
        return path.parent, path
    try:
        it = latest_checkpoint(path) if path.is_dir() else None
    except CheckpointError as e:
        raise NotAMegatronCheckpoint(str(e)) from e
    if it is None:
        raise NotAMegatronCheckpoint(f"{path} is not a Megatron-Core checkpoint (no metadata.json and no 'latest').")
    return path, it


@dataclasses.dataclass(frozen=True)
class Slice:
    """One chunk of a global tensor: `offsets`/`sizes` over all its axes."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype


@contextlib.contextmanager
def _unwrapped_errors():
    """DCP wraps any error raised inside a save or load (even in one process) into a
    CheckpointException (a BaseException); re-raise the original, so a bad source tensor
    reads as the clear error it is."""
    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        if failures and isinstance(failures[0][0], Exception):
            raise failures[0][0] from None
        raise


class _LazySavePlanner(SavePlanner):
    """Plans one DCP item per Slice; `produce(i)` makes slice i's tensor when it is written."""

    def __init__(self, slices: list[Slice], produce: Callable[[int], torch.Tensor]):
        self.slices, self.produce = slices, produce
        self._by_index: dict[tuple, int] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=True) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = []
        for i, s in enumerate(self.slices):
            offsets = torch.Size(s.offsets)
            self._by_index[(s.key, offsets)] = i
            items.append(WriteItem(
                index=MetadataIndex(s.key, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(s.sizes)),
                    properties=TensorProperties(dtype=s.dtype),
                    size=torch.Size(s.global_shape),
                ),
            ))
        return SavePlan(items)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        i = self._by_index[(write_item.index.fqn, write_item.index.offset)]
        s = self.slices[i]
        tensor = self.produce(i)
        if tuple(tensor.shape) != s.sizes or tensor.dtype != s.dtype:
            raise ValueError(f"{s.key}{list(s.offsets)}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {s.sizes} {s.dtype}")
        return tensor


def write_checkpoint(directory: Path, slices: list[Slice], produce: Callable[[int], torch.Tensor],
                     common: dict) -> None:
    """A complete torch_dist checkpoint in `directory` (which must exist and be empty)."""
    # Imported here: the door's version check then speaks when a checkpoint is written,
    # after convert.main has refused an untested Megatron-Core in one line.
    from ..megatron_internals.checkpoint_format import TORCH_DIST_METADATA

    with warnings.catch_warnings(), _unwrapped_errors():  # single-process use of DCP is intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(
            state_dict={},
            # One file per tensor, not one per rank: torch 2.13's FileSystemWriter keeps every
            # tensor of a file alive until that file is finished (filesystem.py, `tensor_dict`),
            # so one file per rank would hold the whole checkpoint in memory.
            storage_writer=FileSystemWriter(str(directory), single_file_per_rank=False, thread_count=1),
            planner=_LazySavePlanner(slices, produce),
            no_dist=True,
        )
    torch.save({"common": common}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(TORCH_DIST_METADATA))


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


class _SliceLoadPlanner(LoadPlanner):
    """Reads the requested slices into fresh tensors (from however the checkpoint was chunked)."""

    def __init__(self, requests: list[Slice]):
        self.requests = requests
        self.out = [torch.empty(r.sizes, dtype=r.dtype) for r in requests]

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for i, r in enumerate(self.requests):
            chunk = ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
            found = create_read_items_for_chunk_list(r.key, self.metadata.state_dict_metadata[r.key], [chunk])
            # Stored chunks do not overlap, so the reads must add up to the request: a
            # region no rank saved would otherwise stay uninitialised memory.
            covered = sum(_numel(item.lengths) for item in found)
            if covered != _numel(r.sizes):
                raise ValueError(f"{r.key}{list(r.offsets)}: the checkpoint holds {covered} of the "
                                 f"{_numel(r.sizes)} values asked for (an incomplete save?)")
            for item in found:
                # dest_index names the destination; the request number goes in its index field.
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(r.key, torch.Size(r.offsets), i)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError("only tensors are read")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        dest = self.out[read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor returned a view: the data is already in place


class CheckpointReader:
    """The tensors of one torch_dist checkpoint directory, read slice by slice."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        refuse_pickled_code(self.dir)  # before torch's own reader touches a file
        self.tensors = {
            k: v for k, v in read_dcp_metadata(self.dir).state_dict_metadata.items() if hasattr(v, "size")
        }
        self.common = read_common(self.dir)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def row_boundaries(self, key: str) -> list[int] | None:
        """Where the stored chunks of a 2-D tensor start along dim 0, when each chunk spans
        whole rows (reading along them reads every stored byte once); else None."""
        md = self.tensors[key]
        if len(md.size) != 2 or any(c.sizes[1] != md.size[1] for c in md.chunks):
            return None
        return sorted({c.offsets[0] for c in md.chunks}) + [md.size[0]]

    def read(self, requests: list[Slice]) -> list[torch.Tensor]:
        planner = _SliceLoadPlanner(requests)
        with warnings.catch_warnings(), _unwrapped_errors():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state_dict={}, storage_reader=FileSystemReader(str(self.dir)), planner=planner, no_dist=True)
        return planner.out
