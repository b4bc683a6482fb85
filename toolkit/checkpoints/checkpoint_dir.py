"""A checkpoint root on disk, read without torch: the `latest` pointer, iteration names,
and what validation checks before a run loads it.

    iter_0000010/     one complete checkpoint (step 10): Megatron-Core's distributed
                      format, or DeepSpeed's files with gridwright's manifest beside them
    latest            the name of the newest complete one (replaced atomically)

Saving and loading tensors is the engines' job (`engines.megatron_checkpoint`,
`engines.deepspeed_checkpoint`); this module stays
free of torch so that composing, validating and planning a run stay fast (only reading a
checkpoint's `common.pt` imports torch, and only a local launch with `checkpoint.load`
does that).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import socket
from pathlib import Path

from ..basics.path_rules import PathRefused, entry_problem, open_regular, read_bounded_text, tree_problem, what_is
from .checkpoint_trust import UntrustedCheckpointFile, load_torch_file, read_dcp_metadata, refuse_pickled_code

LATEST = "latest"
WRITER_LOCK = ".writer.lock"  # POSIX lock held by the one run writing this root (see hold_writer_lock)
# Written last into a DeepSpeed checkpoint: what the run was (common state) and every
# file with its size, so a cut-short file is found before a load (DeepSpeed has no index).
DEEPSPEED_MANIFEST = "gridwright_deepspeed.json"
# How to carry a checkpoint of one format to the other engine (by the format engine_of names).
CONVERSION_HINT = {
    "deepspeed": "convert it first: python -m gridwright.adapters.convert deepspeed-to-megatron --deepspeed {root} "
                 "--out DIR",
    "megatron": "convert it to a Hugging Face folder (python -m gridwright.adapters.convert megatron-to-hf "
                "--megatron {root} --out DIR) and start from that",
}
_ITERATION = re.compile(r"iter_(\d{7,})")  # 7 digits, more from step 10,000,000 on
POINTER_BYTES = 64  # what `latest` may hold: one iteration's name and a newline
LOCK_BYTES = 256  # what the writer lock holds: {"host": ..., "pid": ...}
MANIFEST_BYTES = 64 << 20  # a DeepSpeed manifest: a JSON list of files and the common state

# Model fields a run may change from its checkpoint's: they shape neither the weights nor
# the function the weights compute.
MAY_DIFFER = ("name", "max_position_embeddings", "moe_aux_loss_coeff")


class CheckpointError(RuntimeError):
    pass


class BadPointer(CheckpointError):
    """`latest` is not a small regular file naming a complete iteration in its root: input
    the user can act on (one line, exit 2, on every path that reads it)."""


def iteration_name(step: int) -> str:
    return f"iter_{step:07d}"


def step_of(path: str | os.PathLike) -> int:
    """The step a checkpoint directory was saved after, from its name (`iter_0000010` -> 10)."""
    match = _ITERATION.fullmatch(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not named like a checkpoint (iter_NNNNNNN).")
    return int(match.group(1))


def latest_name(root: str | os.PathLike) -> str | None:
    """What `root/latest` holds, stripped, or None without one. The pointer is read as a
    small regular file (never a link, a FIFO or a device); its content is never echoed."""
    pointer = Path(root) / LATEST
    if not os.path.lexists(pointer):
        return None
    try:
        return read_bounded_text(pointer, POINTER_BYTES, "the name of one iteration").strip()
    except PathRefused as e:
        raise BadPointer(f"{e}. Fix: point checkpoint.load at an intact checkpoint directory.") from None


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root` (latest_name), or None when there is none."""
    root = Path(root)
    pointer, name = root / LATEST, latest_name(root)
    if name is None:
        return None
    path = root / name
    if not _ITERATION.fullmatch(name):
        raise BadPointer(
            f"{pointer} names no iteration (it should hold iter_NNNNNNN). "
            "Fix: point checkpoint.load at an intact checkpoint directory.")
    if what_is(path) == "nothing":
        problem = "it does not exist, so it is not a complete checkpoint"
    else:
        problem = entry_problem(path, root, "directory")
    if problem is None and not ((path / "metadata.json").is_file() or (path / DEEPSPEED_MANIFEST).is_file()):
        problem = "it is not a complete checkpoint (no metadata.json, no manifest)"
    if problem:
        raise BadPointer(
            f"{pointer} names '{name}': {problem}. Fix: point checkpoint.load at an intact checkpoint directory.")
    return path


def root_problem(root: str | os.PathLike) -> str | None:
    """Why the checkpoint root `root` may not be read or written, or None: every entry
    directly in it must be a regular file or a directory (no links, FIFOs, devices), so
    that retention, the writer lock and `latest` never act through one."""
    root = Path(root)
    if not root.is_dir():
        return None
    for entry in sorted(os.listdir(root)):
        found = what_is(root / entry)
        if found not in ("a regular file", "a directory"):
            return (f"{root / entry} is {found}, in the checkpoint root {root}: refused (gridwright writes, reads "
                    "and removes only its own files there). Fix: remove it, or use another directory.")
    return None


def damage(path: str | os.PathLike, trust: bool | None = None) -> str | None:
    """What is wrong with one checkpoint directory's files, or None when every file the
    checkpoint's index (`.metadata`, torch.distributed.checkpoint's) names is present and
    long enough, and both metadata files read. A truncated shard fails here, before any
    process starts, instead of deep inside a load. A `.metadata` that would run code
    raises UntrustedCheckpointFile (unless `trust`)."""
    path = Path(path)
    problem = tree_problem(path)
    if problem:
        return problem
    if (path / DEEPSPEED_MANIFEST).exists():
        return _deepspeed_damage(path)
    try:
        json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        return f"{path / 'metadata.json'} is unreadable ({type(e).__name__})"
    if not (path / "common.pt").is_file():
        return f"{path / 'common.pt'} is missing"
    try:
        index = read_dcp_metadata(path, trust=trust)
    except UntrustedCheckpointFile:
        raise
    except Exception as e:  # a truncated or foreign pickle
        return f"{path / '.metadata'} is unreadable ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} is cut short ({file.stat().st_size} of {size} bytes)"
    return None


def _deepspeed_damage(path: Path) -> str | None:
    try:
        files = read_manifest(path)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path / DEEPSPEED_MANIFEST} is unreadable ({type(e).__name__})"
    for name, size in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, not the {size} it was written with"
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    """The DeepSpeed manifest of one iteration directory (a bounded read of a regular file)."""
    return json.loads(read_bounded_text(Path(path) / DEEPSPEED_MANIFEST, MANIFEST_BYTES, "a checkpoint's manifest"))


def engine_of(path: str | os.PathLike) -> str:
    """Which engine wrote one checkpoint directory: "deepspeed" or "megatron"."""
    return "deepspeed" if (Path(path) / DEEPSPEED_MANIFEST).exists() else "megatron"


def holds_checkpoints(root: str | os.PathLike) -> bool:
    """Whether `root` is a checkpoint root (it has a `latest` pointer), not e.g. a Hugging
    Face folder given as initial weights."""
    return os.path.lexists(Path(root) / LATEST)


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under `path` (one checkpoint directory): the size its save and
    load lines report."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def iterations(root: str | os.PathLike) -> list[Path]:
    """The checkpoint directories under `root` (`iter_N`, complete or not; not `.partial`),
    oldest first."""
    found = [p for p in Path(root).iterdir() if _ITERATION.fullmatch(p.name) and what_is(p) == "a directory"]
    return sorted(found, key=step_of)


def newest_intact(root: str | os.PathLike, besides: Path, trust: bool | None = None) -> Path | None:
    """The newest complete, undamaged checkpoint under `root` other than `besides`."""
    found = [p for p in reversed(iterations(root)) if p != besides]
    return next((p for p in found if damage(p, trust) is None), None)


def checkpoint_to_load(root: str | os.PathLike, fallback: bool = False, trust: bool | None = None) -> Path | None:
    """The checkpoint a run resumes from: the latest, if intact; with `fallback`, else the
    newest intact one. A damaged latest is refused, naming the one that would load."""
    path = latest_checkpoint(root)
    if path is None:
        return None
    problem = damage(path, trust)
    if problem is None:
        return path
    older = newest_intact(root, besides=path, trust=trust)
    if fallback and older is not None:
        return older
    hint = (f"The newest intact checkpoint is {older.name}: set checkpoint.fallback=true to resume from it."
            if older is not None else "No intact checkpoint is left beside it.")
    raise CheckpointError(f"the latest checkpoint {path} is damaged: {problem}. {hint}")


def hold_writer_lock(root: str | os.PathLike):
    """Take the root's writer lock for the life of this process (returns the open file,
    which holds it). The kernel drops the lock with its holder, so a killed run never
    holds a directory; the file says who holds it. Raises CheckpointError if held.

    A POSIX record lock (lockf), not flock: an flock belongs to the open file, which
    every forked child shares (the checkpoint writer's helpers, data loaders), so a
    killed worker's orphaned children kept the directory locked against torchrun's
    restart of the same job (measured). A record lock belongs to this process only."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    handle = _open_lock(root, os.O_RDWR | os.O_CREAT, "r+")  # created if missing
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EACCES or EAGAIN: another process holds it
        handle.seek(0)
        holder = _holder(handle.read(LOCK_BYTES))
        handle.close()
        raise CheckpointError(busy_message(root, holder)) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    handle.flush()
    return handle


def _open_lock(root: Path, flags: int, mode: str):
    """The root's writer lock file, opened never through a link and never on a FIFO
    (path_rules.open_regular); PathRefused says what it is and how to go on."""
    try:
        return os.fdopen(open_regular(root / WRITER_LOCK, flags), mode)
    except PathRefused as e:
        raise PathRefused(f"{e}. Fix: remove it, or save elsewhere.") from None


def _holder(text: str) -> str:
    try:
        rec = json.loads(text)
        return f"host {rec['host']} pid {rec['pid']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no name"


def busy_message(root: str | os.PathLike, holder: str) -> str:
    return (f"{root} is being written by another run ({holder}); one run writes a checkpoint directory "
            "at a time. Fix: stop that run, or save elsewhere.")


def writer_problem(root: str | os.PathLike) -> str | None:
    """Why this process may not write `root` now (a live run holds its writer lock), or None."""
    path = Path(root) / WRITER_LOCK
    if not os.path.lexists(path):
        return None
    try:
        handle = _open_lock(Path(root), os.O_RDONLY, "r")
    except PathRefused as e:
        return str(e)
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return busy_message(root, _holder(handle.read(LOCK_BYTES)))
        fcntl.lockf(handle, fcntl.LOCK_UN)
    return None


def read_common(path: str | os.PathLike, trust: bool | None = None) -> dict:
    """The common (non-sharded) state of one checkpoint directory: step, model, layout...
    (`common.pt` is a torch pickle: read through the allowlist unless `trust`)."""
    manifest = Path(path) / DEEPSPEED_MANIFEST
    if manifest.is_file():  # DeepSpeed's own files are beside a JSON manifest of ours
        return read_manifest(path)["common"]
    return load_torch_file(Path(path) / "common.pt", trust=trust)["common"]


def _differing(recorded: dict, model_cfg) -> list[tuple[str, object, object]]:
    """(key, this config's value, the checkpoint's) for each model field that differs."""
    from ..families.hf_config import head_dim

    out = []
    for key, value in recorded.items():
        if key in MAY_DIFFER or key not in model_cfg:
            continue
        if key == "head_dim":  # a size: None means hidden / heads
            if head_dim(recorded) != head_dim(model_cfg):
                out.append((key, head_dim(model_cfg), head_dim(recorded)))
        elif model_cfg[key] != value:
            out.append((key, model_cfg[key], value))
    return out


def model_differences(recorded: dict, model_cfg) -> list[str]:
    """Fields of the model config that differ from the one a checkpoint was written for."""
    return [f"model.{key}={here} (checkpoint: {there})" for key, here, there in _differing(recorded, model_cfg)]


def shape_fix(recorded: dict, model_cfg) -> str:
    """The overrides that give the checkpoint's model shape: where it names another preset
    that conf/model has, `model=NAME` and the values in which the checkpoint differs from
    that preset; else the checkpoint's values where this model differs (the user's own
    `model.KEY=` overrides of this preset are then overridden in turn)."""
    from omegaconf import OmegaConf

    from ..basics.conf_dir import CONF_DIR

    preset = CONF_DIR / "model" / f"{recorded.get('name')}.yaml"
    words = []
    if recorded.get("name") != model_cfg.get("name") and preset.is_file():
        # the preset's own keys (a key it leaves to the schema's default is compared once it is chosen)
        model_cfg = OmegaConf.load(preset)
        words.append(f"model={recorded['name']}")
    for key, _, value in _differing(recorded, model_cfg):
        word = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        words.append(f"model.{key}={word}")
    return " ".join(words)


def describe_problem(root: str | os.PathLike, model_cfg=None, fallback: bool = False, engine: str | None = None,
                     trust: bool = False) -> str | None:
    """Why `root` cannot be loaded (used by validation before anything starts): missing,
    damaged, a pickled file that would run code (unless `trust`), another model shape,
    or written by another `engine` than the one named."""
    root = Path(root)
    if not root.is_dir():
        return f"checkpoint.load={root} does not exist."
    problem = root_problem(root)
    if problem:
        return problem
    path = root / LATEST
    try:
        path = checkpoint_to_load(root, fallback, trust)
        if path is None:
            return f"checkpoint.load={root} has no '{LATEST}' file: it holds no complete checkpoint."
        refuse_pickled_code(path, trust)
        common = read_common(path, trust)
    except (CheckpointError, UntrustedCheckpointFile) as e:
        return str(e)
    except Exception as e:  # an unreadable pointer, a truncated or foreign common.pt
        return f"checkpoint.load={root}: cannot read {path} ({e})."
    written_by = engine_of(path)
    if engine is not None and written_by != engine:
        return (f"checkpoint.load={root} holds a {written_by} checkpoint, which engine={engine} cannot resume. "
                f"Fix: engine={written_by} to resume it, or {CONVERSION_HINT[written_by].format(root=root)}.")
    recorded = common.get("model_config")
    if model_cfg is not None and recorded:
        diffs = model_differences(recorded, model_cfg)
        if diffs:
            fix = common.get("model_yaml_hint") or f"{shape_fix(recorded, model_cfg)} to resume it, or a checkpoint of this model."
            return f"checkpoint.load={root} was written for another model shape: {', '.join(diffs)}. Fix: {fix}"
    return None


def nothing_to_resume(checkpoint, train) -> str | None:
    """Why resuming from `checkpoint.load` would train no step (it already reached
    `train.steps`), or None. Loading a model to then stop takes minutes: say so instead."""
    ck = checkpoint
    if not ck.load or ck.weights_only or not Path(ck.load).is_dir():
        return None
    try:
        path = latest_checkpoint(ck.load)
    except CheckpointError:
        return None  # validation reports it
    step = step_of(path) if path is not None else 0
    if step < train.steps:
        return None
    return (f"nothing to train: checkpoint.load={ck.load} is at step {step} ({path.name}) and "
            f"train.steps={train.steps}. To train further, raise train.steps.")
