"""Checkpoint files are read without running code they carry.

Megatron-Core and DeepSpeed checkpoints are pickles: `common.pt`, torch.distributed
.checkpoint's `.metadata`, the objects inside its `.distcp` shards, and DeepSpeed's model,
optimizer and universal states. Unpickling runs whatever callable a file names, so a
checkpoint someone else wrote could run code on the launcher and on every node. Here every
such file is read with an allowlist instead:

* torch's zip files through `torch.load(weights_only=True)`, with torch's own allowlist
  mechanism (`torch.serialization.safe_globals`) widened by the few classes DeepSpeed's
  optimizer states hold (its loss scaler, fragment address and ZeRO-stage enum);
* DCP's `.metadata`, a plain pickle, through a restricted unpickler that admits
  torch.distributed.checkpoint's own dataclasses and enums, `torch.Size`, dtypes and
  POSIX paths (the storage id of a checkpoint the converter wrote), and never sets
  attributes on a class.

A file that names anything else is refused in one line naming the file and the global.
`checkpoint.trust_pickled_code=true` (the converter: `--trust-pickled-code`) reads with
full pickle, for a checkpoint of one's own that carries other objects.

Upstream readers (Megatron-Core's `common.pt` load, DCP's metadata read and byte-object
load, DeepSpeed's engine and `zero_to_fp32` loads) call `torch.load` or DCP's reader
themselves; `guard_process` routes both through the readers here for the whole process.
The upstream lines it stands in for are in `CITED`, which a test checks against the
installed packages. torch is imported lazily: validation imports this module.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import re
from pathlib import Path

from ..basics.path_rules import PathRefused, tree_problem

TRUST_KEY = "checkpoint.trust_pickled_code"
TRUST_FLAG = "--trust-pickled-code"
# Carries a process's policy to the processes it starts (the converter's logits workers).
TRUST_ENV = "GRIDWRIGHT_TRUST_PICKLED_CODE"

# (package, file under it, a line it holds): the upstream readers guard_process covers.
CITED = [
    ("torch", "distributed/checkpoint/filesystem.py", "metadata = pickle.load(metadata_file)"),
    ("torch", "distributed/checkpoint/default_planner.py", "torch.load(value, weights_only=False)"),
    ("megatron.core", "dist_checkpointing/strategies/common.py", "return torch.load(load_path, map_location='cpu')"),
    ("deepspeed", "runtime/checkpoint_engine/torch_checkpoint_engine.py", "torch.load(path, map_location=map_location"),
    ("deepspeed", "utils/zero_to_fp32.py", "torch.load(file, map_location=device, weights_only=False)"),
    # run as a subprocess through guarded_module_command
    ("deepspeed", "checkpoint/ds_to_universal.py", "state_dict = torch.load(optim_file, map_location='cpu', weights_only=False)"),
]

# The modules whose dataclasses and enums make up a DCP `.metadata` file.
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                         "torch.distributed.checkpoint.filesystem")


class UntrustedCheckpointFile(RuntimeError):
    """A checkpoint file that needs a global outside the allowlist to be read."""

    def __init__(self, where: str, needs: str):
        self.where, self.needs = where, needs
        super().__init__(
            f"{where} needs {needs} to be unpickled, which could run code: refused. Fix: only if you wrote this "
            f"checkpoint or trust its source, set {TRUST_KEY}=true (convert: {TRUST_FLAG}).")


# torch's default weights-only set covers gridwright's own checkpoints. numpy is
# deliberately absent: `dtype.__setstate__` takes field layouts from the file, which can
# make an array read file bytes as object pointers (a reviewer's crafted common.pt crashed
# a worker that way), so RNG states are saved without numpy.
# DeepSpeed's optimizer states hold these objects. Importing DeepSpeed takes seconds and
# prints, so they are added only when a file names one of them.
def _deepspeed_allowlist() -> list:
    from ..deepspeed_internals.checkpoint_files import pickled_classes

    return pickled_classes()


_REAL_TORCH_LOAD = None  # torch.load as torch defines it, kept before guard_process replaces it
_PROCESS_TRUSTS = False  # what guard_process decided for this process: the default of every reader here


def _trusted(trust: bool | None) -> bool:
    return _PROCESS_TRUSTS if trust is None else trust


def _real_torch_load():
    global _REAL_TORCH_LOAD
    if _REAL_TORCH_LOAD is None:
        import torch

        _REAL_TORCH_LOAD = getattr(torch.load, "_unguarded", torch.load)
    return _REAL_TORCH_LOAD


def _describe(source) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else "an object stored inside a checkpoint shard"


def load_torch_file(source, *, trust: bool | None = None, map_location="cpu", **kwargs):
    """`torch.load` of a checkpoint file (a path or a file object) that runs no code
    unless trusted (`trust`, else this process's policy): weights only, with gridwright's
    allowlist."""
    load = _real_torch_load()
    if _trusted(trust):
        return load(source, map_location=map_location, weights_only=False, **kwargs)
    try:
        return _load_weights_only(load, source, [], map_location, kwargs)
    except UntrustedCheckpointFile as e:
        if not e.needs.startswith("deepspeed."):
            raise
        try:
            allowed = _deepspeed_allowlist()
        except RuntimeError:  # no tested DeepSpeed here (the fence refuses): the file stays refused
            raise e from None
        if e.needs not in {f"{c.__module__}.{c.__qualname__}" for c in allowed}:
            raise
    if hasattr(source, "seek"):
        source.seek(0)
    return _load_weights_only(load, source, allowed, map_location, kwargs)


def _load_weights_only(load, source, allowed: list, map_location, kwargs):
    import torch

    with torch.serialization.safe_globals(allowed):
        try:
            return load(source, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            named = found.group(1) if found else "a pickle instruction torch's weights-only reader refuses"
    raise UntrustedCheckpointFile(_describe(source), named)


# The dtypes a tensor's properties may name (looked up by name, never through torch's
# module __getattr__, which imports lazily).
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                "uint16", "uint32", "uint64")


class _MetadataUnpickler(pickle._Unpickler):
    """DCP's `.metadata` with nothing callable but its own record types. Every global a
    pickle uses (for calls, new objects, extension codes) comes through `find_class`,
    which admits only dataclasses and enums defined in DCP's own metadata modules,
    `torch.Size`, dtypes and POSIX paths. BUILD on a class (which would set attributes on
    it for the whole process) is refused: that needs the pure-Python unpickler, whose
    opcodes can be overridden; `.metadata` files are small."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def load_build(self):
        if isinstance(self.stack[-2], type):
            raise UntrustedCheckpointFile(self.where, f"a change to the class {self.stack[-2].__qualname__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str):
        import importlib

        import torch

        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and name in _DTYPE_NAMES and hasattr(torch, name):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # torch.layout by name (torch.strided)
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # a path object only holds parts
            import pathlib

            return getattr(pathlib, name)
        if module in _DCP_METADATA_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if (isinstance(found, type) and found.__module__ == module and found is not enum.Enum
                    and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))):
                return found
        raise UntrustedCheckpointFile(self.where, f"{module}.{name}")


def read_dcp_metadata(checkpoint_dir: str | os.PathLike, trust: bool | None = None):
    """torch.distributed.checkpoint's index of one checkpoint directory, as its
    `FileSystemReader.read_metadata` returns it, read without running code unless trusted."""
    path = Path(checkpoint_dir) / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f) if _trusted(trust) else _MetadataUnpickler(f, str(path)).load()
    return _fill_storage_meta(metadata)


def _fill_storage_meta(metadata, load_id=None):
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def refuse_pickled_code(iteration_dir: str | os.PathLike, trust: bool | None = None) -> None:
    """Refuse an entry that is not a regular file or a directory (PathRefused), then read
    every pickled record of one checkpoint directory through the allowlist before any
    upstream reader touches it; raises UntrustedCheckpointFile naming the first file that
    needs more. Tensors are memory-mapped, not read, so this stays cheap."""
    path = Path(iteration_dir)
    problem = tree_problem(path)  # no link, FIFO or device is opened, trusted or not
    if problem:
        raise PathRefused(problem)
    if _trusted(trust):
        return
    for file in sorted(path.rglob("*")):
        if file.is_file() and _is_torch_pickle(file):
            _load_mapped(file)
    if (path / ".metadata").is_file():
        for fqn, where, value in dcp_objects(path):
            refuse_unsafe_extra_states({fqn: value}, where)


def dcp_objects(iteration_dir: str | os.PathLike):
    """(name, where, value) of every pickled object in a DCP checkpoint's `.distcp` shards,
    each read through the allowlist (load_torch_file); raises UntrustedCheckpointFile for an
    object that needs more, or an index entry that points outside the checkpoint."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = Path(iteration_dir)
    metadata = read_dcp_metadata(path)
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue
        info = (metadata.storage_data or {}).get(MetadataIndex(fqn))
        if info is None:
            continue
        shard = (path / info.relative_path).resolve()
        if shard.parent != path.resolve() or not shard.is_file():
            raise UntrustedCheckpointFile(f"{path / '.metadata'}", f"a shard outside the checkpoint ({info.relative_path})")
        with open(shard, "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        where = f"{path / info.relative_path} (object '{fqn}')"
        try:
            yield fqn, where, load_torch_file(io.BytesIO(record))
        except UntrustedCheckpointFile as e:
            raise UntrustedCheckpointFile(where, e.needs) from None


def refuse_unsafe_extra_states(state: dict, where: str) -> int:
    """Read every Transformer Engine `_extra_state` in a loaded state dict without running
    code (te_extra_state); raises UntrustedCheckpointFile naming `where`, the key and the
    global. Returns how many held a pickle."""
    from .te_extra_state import UnsafeExtraState, read_all

    try:
        return read_all(state)
    except UnsafeExtraState as e:
        raise UntrustedCheckpointFile(f"{where} (Transformer Engine extra state '{e.key}')", e.needs) from None


def load_state_dict_vetted(module, state: dict, where: str, strict: bool = False):
    """`module.load_state_dict(state)`, every TE extra state in it read safely first; TE
    then unpickles exactly those in-memory bytes, with its opt-in set for this call only.
    With trust (checkpoint.trust_pickled_code) TE reads them itself, opted in."""
    from .te_extra_state import te_reads_vetted_pickles

    if not _trusted(None) and refuse_unsafe_extra_states(state, where) == 0:
        return module.load_state_dict(state, strict=strict)
    with te_reads_vetted_pickles():
        return module.load_state_dict(state, strict=strict)


def refuse_pickled_code_on_every_rank(iteration_dir: str | os.PathLike) -> None:
    """Collective: rank 0 scans (refuse_pickled_code) and every rank raises its verdict,
    so a job's ranks refuse together, before any of them reads a file, and a checkpoint
    is scanned once, not once per rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        refuse_pickled_code(iteration_dir)
        return
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            refuse_pickled_code(iteration_dir)
        except UntrustedCheckpointFile as e:
            verdict = [("code", e.where, e.needs)]
        except PathRefused as e:
            verdict = [("path", str(e))]
    dist.broadcast_object_list(verdict, src=0)  # rank 0's own strings: no file is unpickled here
    if verdict[0] is not None:
        raise UntrustedCheckpointFile(*verdict[0][1:]) if verdict[0][0] == "code" else PathRefused(verdict[0][1])


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip container


def _is_torch_pickle(file: Path) -> bool:
    """Whether a later reader may unpickle `file` as torch does: named `*.pt`, or, whatever
    its name, a zip container or a pickle (protocol 2 on). DCP's `.metadata` and `.distcp`
    shards have their own readers (read_dcp_metadata, dcp_objects)."""
    if file.name == ".metadata" or file.suffix == ".distcp":
        return False
    if file.suffix == ".pt":
        return True
    with open(file, "rb") as f:
        head = f.read(4)
    return head == _ZIP_MAGIC or head[:1] == b"\x80"


def _load_mapped(file: Path) -> None:
    try:
        load_torch_file(file, mmap=True)
    except RuntimeError as e:  # a file in torch's legacy (non-zip) format cannot be mapped
        if "mmap" not in str(e):
            raise
        load_torch_file(file)


def guard_process(trust: bool = False) -> None:
    """From here on, in this process, `torch.load` reads with gridwright's allowlist (a
    call's own `weights_only=False` is overridden) and DCP's `FileSystemReader` reads
    `.metadata` through the restricted unpickler: Megatron-Core's and DeepSpeed's loaders
    then run no code from a checkpoint either (the calls in `CITED`). With `trust`, nothing
    is hooked and the readers here read with full pickle too. Commands call it first
    (worker, converter, logits worker); library code relies on their choice. Idempotent."""
    global _PROCESS_TRUSTS
    _PROCESS_TRUSTS = trust
    os.environ[TRUST_ENV] = "1" if trust else "0"
    if trust:
        return
    import torch
    from torch.distributed.checkpoint import filesystem

    if getattr(torch.load, "_unguarded", None) is not None:
        return
    real = _real_torch_load()

    def guarded_load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
        return load_torch_file(f, map_location=map_location, **kwargs)  # pickle_module: weights-only has its own

    guarded_load._unguarded = real
    guarded_load.__doc__ = "torch.load, with gridwright's checkpoint allowlist (gridwright.checkpoints.checkpoint_trust)."
    torch.load = guarded_load

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        where = self._get_metadata_path(rank)
        with self.fs.create_stream(where, "rb") as f:
            metadata = _MetadataUnpickler(f, str(where)).load()
        return _fill_storage_meta(metadata, self.load_id)

    read_metadata._unguarded = filesystem.FileSystemReader.read_metadata
    filesystem.FileSystemReader.read_metadata = read_metadata


def unguard_process() -> None:
    """Undo guard_process: torch's own `torch.load` and DCP metadata reader again. For a
    process that calls a command's `main` in-process and goes on (the test suite)."""
    global _PROCESS_TRUSTS
    import sys

    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.load, "_unguarded", None) is None:
        return
    from torch.distributed.checkpoint import filesystem

    torch.load = torch.load._unguarded
    reader = filesystem.FileSystemReader
    reader.read_metadata = getattr(reader.read_metadata, "_unguarded", reader.read_metadata)
    _PROCESS_TRUSTS = False
    os.environ.pop(TRUST_ENV, None)


def inherited_trust() -> bool:
    """The policy of the process that started this one (guard_process exports it)."""
    return os.environ.get(TRUST_ENV) == "1"


def guarded_module_command(module: str, args: list[str]) -> list[str]:
    """A command line that runs `python -m module args` under this process's policy: for
    upstream tools gridwright starts as subprocesses (DeepSpeed's universal converter)."""
    import sys

    if _PROCESS_TRUSTS:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "gridwright.checkpoints.checkpoint_trust", module, *args]


if __name__ == "__main__":  # python -m gridwright.checkpoints.checkpoint_trust MODULE ARGS...
    import runpy
    import sys

    guard_process()
    target = sys.argv[1]
    sys.argv = [target, *sys.argv[2:]]
    from gridwright.basics.process_exit import skip_final_collection

    try:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        skip_final_collection()
