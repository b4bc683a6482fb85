"""Checkpoint conversion between Hugging Face and Megatron-Core, both directions, and
from the DeepSpeed engine's checkpoints to either.

    python -m gridwright.adapters.convert hf-to-megatron --hf DIR --out DIR [--tp 2 --pp 2 --ep 2] [--verify]
    python -m gridwright.adapters.convert megatron-to-hf --megatron DIR --out DIR [--verify]
    python -m gridwright.adapters.convert deepspeed-to-hf --deepspeed DIR --out DIR [--verify]
    python -m gridwright.adapters.convert deepspeed-to-megatron --deepspeed DIR --out DIR [--tp 2 ...] [--verify]

Everything is checked before a byte is written: the architecture (refusals in
families.hf_config), the target layout (gridwright's own validation rules), and that every
source tensor is mapped or explicitly accounted for, with the shape the config implies.
Tensors then stream one at a time into a temporary directory that is renamed into place
when complete. The output records its source, layout and the toolkit version.

The Megatron-Core checkpoint is layout-independent (tensors are stored with their global
shapes and Megatron-Core reshards on load), so `--tp/--pp/--vpp/--ep` choose the layout
that is validated, recorded, and used by `--verify`; a training run may load the same
checkpoint at any other valid layout.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..basics.atomic_io import remove_stale_stages, scratch_directory, staged_directory, unwritable_reason
from ..checkpoints.checkpoint_dir import LATEST, iteration_name
from ..checkpoints.checkpoint_trust import TRUST_FLAG, UntrustedCheckpointFile, guard_process
from ..families import weight_table as wm
from ..families.declaration import UnsupportedModel
from ..families.hf_config import (
    default_model_name,
    hf_config_from_model,
    model_config_from_hf,
    raw_hf_config,
    read_hf_config,
    same_model,
    transformers_config,
)
from ..versions.megatron_version import refusal as megatron_core_refusal
from ..basics.known_warnings import filter_known_warnings
from ..versions.torch_version import refusal as torch_refusal
from .deepspeed_files import NotADeepSpeedCheckpoint, consolidated_weights, find_deepspeed_checkpoint, read_manifest
from .hf_files import SIDE_FILES, SafetensorsSource, StreamingSafetensorsWriter
from .logits_worker import layout_run_config
from .megatron_files import CheckpointReader, Slice, find_checkpoint, write_checkpoint

ITERATION = iteration_name(0)  # a converted checkpoint holds weights: training starts at step 0
RECORD = "conversion.json"
HF_SOURCE = "hf_source"  # config.json and tokenizer files of the source, kept for the way back
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
EXIT_INVALID = 2
# Large unstacked tensors (embedding, output layer: 1 GB each for Llama-3-8B) move in row
# blocks of at most this many elements, so no step holds one whole.
ROW_BLOCK_ELEMENTS = 32 * 1024**2


class ConversionError(ValueError):
    """Bad input; raised before anything is written."""


def toolkit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gridwright")
    except PackageNotFoundError:
        return "unknown"


def check_layout(model: dict, tp: int, pp: int, vpp: int | None, ep: int) -> dict:
    """Validate the target layout with the same rules as `launch.py`; returns its record."""
    from ..validation.validate import ConfigError, validate

    cfg = layout_run_config(model, tp, pp, vpp, ep, seq_length=8 * tp)
    cfg.launcher.name, cfg.tracking.enabled = "plan", False
    cfg.train.global_batch_size = pp * ep
    cfg.train.steps, cfg.train.warmup_steps = 2, 0
    try:
        validate(cfg, for_launch=False)
    except ConfigError as e:
        raise ConversionError(f"target layout TP={tp} PP={pp} VPP={vpp} EP={ep} does not fit the model:\n{e}") from e
    return {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep}


def row_blocks(piece: wm.Piece) -> list[tuple[int, int]]:
    """[(first row, end row)] in which a piece is moved: blocks for large plain copies."""
    rows = piece.shape[0]
    if piece.combine != "copy" or piece.index or len(piece.shape) != 2:
        return [(0, rows)]
    step = max(1, ROW_BLOCK_ELEMENTS // piece.shape[1])
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _slices(piece: wm.Piece, global_shape: tuple, dtype: torch.dtype) -> list[Slice]:
    """The checkpoint chunks of one piece: (layer[, expert]) position, then row blocks."""
    out = []
    for a, b in row_blocks(piece):
        offsets = piece.index + (a,) + (0,) * (len(piece.shape) - 1)
        sizes = (1,) * len(piece.index) + (b - a,) + piece.shape[1:]
        out.append(Slice(piece.key, offsets, sizes, global_shape, dtype))
    return out


def _export_slices(reader: CheckpointReader, piece: wm.Piece, global_shape: tuple) -> list[Slice]:
    """Reads for one piece. A large plain tensor is read along the chunks it was stored in
    (row blocks when the converter wrote it, TP parts when a training run did), so each
    stored byte is read once; everything else in one read."""
    dtype = reader.dtype(piece.key)
    whole = Slice(piece.key, piece.index + (0,) * len(piece.shape), (1,) * len(piece.index) + piece.shape,
                  global_shape, dtype)
    bounds = reader.row_boundaries(piece.key) if row_blocks(piece) != [(0, piece.shape[0])] else None
    if not bounds or len(bounds) <= 2:  # not a large plain tensor, or stored in one chunk
        return [whole]
    return [Slice(piece.key, (a, 0), (b - a, piece.shape[1]), global_shape, dtype) for a, b in zip(bounds, bounds[1:])]


def _progress(total_bytes: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=None, file=sys.stderr)


# --- Hugging Face -> Megatron-Core -------------------------------------------------------


def plan_hf_to_megatron(src: SafetensorsSource, model: dict, dtype: torch.dtype | None):
    """Check every source tensor against the map; return (pieces, dtype per key)."""
    pieces = wm.pieces(model)
    expected = {name for p in pieces for name in p.hf_names}
    present = src.names()
    derived = {n for n in present if n.endswith(wm.HF_DERIVED_SUFFIXES)}
    embedding = next(p for p in pieces if p.key == wm.EMBEDDING)
    head_name = wm.tied_output_hf_name(model)  # what a tied model's file may still carry
    tied_head = {head_name} & present if model["tie_embeddings"] else set()
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - derived - tied_head)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:6])}")
    if unexpected:
        problems.append(f"unexpected tensors, not mapped ({len(unexpected)}): {', '.join(unexpected[:6])}")
    key_dtypes: dict[str, str] = {}
    for p in pieces:
        for name, shape in zip(p.hf_names, wm.hf_shapes(p, model)):
            if name not in present:
                continue
            got_dtype, got_shape = src.meta[name]
            if got_shape != shape:
                problems.append(f"{name} has shape {list(got_shape)}, config.json implies {list(shape)}")
            if key_dtypes.setdefault(p.key, got_dtype) != got_dtype:
                problems.append(f"{name} is {got_dtype} but other tensors of {p.key} are {key_dtypes[p.key]}")
    if tied_head and not problems:
        embedding_name = embedding.hf_names[0]
        for a, b in row_blocks(embedding):  # in row blocks: the embedding may be 1 GB
            if not torch.equal(src.get_rows(head_name, a, b), src.get_rows(embedding_name, a, b)):
                problems.append(f"tie_word_embeddings=true but {head_name} differs from {embedding_name}")
                break
    if problems:
        raise ConversionError("the source does not match its config.json:\n  - " + "\n  - ".join(problems))
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    dtypes = {}
    for key, name in key_dtypes.items():
        if name not in names:
            raise ConversionError(f"{key}: dtype {name} is not one of {', '.join(names)}")
        dtypes[key] = dtype or names[name]
    return pieces, dtypes


def hf_to_megatron(hf_dir, out_dir, tp=1, pp=1, vpp=None, ep=1, name=None, dtype=None, overwrite=False,
                   before_publish=None, source: dict | None = None) -> dict:
    """Convert; returns the record written to `out_dir/conversion.json`. `before_publish(staged
    output, record)` runs before the output is renamed into place: raising there leaves no output.
    `source` replaces the record's direction and source (a conversion that passed through
    a temporary Hugging Face folder names what it started from)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    raw = raw_hf_config(hf_dir)
    src = SafetensorsSource(hf_dir)
    contradicted = src.size_disagreements(raw)
    if contradicted:
        raise ConversionError(f"{hf_dir / 'config.json'} does not match its safetensors files: "
                              + "; ".join(contradicted) + ".")
    hf = read_hf_config(hf_dir)
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ConversionError(f"--name '{name}' must be letters, digits and underscores (it names a config file).")
    model = model_config_from_hf(hf, name or default_model_name(hf_dir))
    layout = check_layout(model, tp, pp, vpp, ep)
    pieces, dtypes = plan_hf_to_megatron(src, model, dtype)
    shapes = wm.global_shapes(model)
    work = [(p, s) for p in pieces for s in _slices(p, shapes[p.key], dtypes[p.key])]
    slices = [s for _, s in work]
    start = time.perf_counter()
    with staged_directory(out_dir, overwrite) as tmp, _progress(src.total_bytes(), "hf->megatron") as bar:

        def produce(i: int) -> torch.Tensor:
            p, s = work[i]
            if row_blocks(p) != [(0, p.shape[0])]:  # one block of a large plain copy
                first = s.offsets[len(p.index)]
                t = src.get_rows(p.hf_names[0], first, first + s.sizes[len(p.index)])
            else:
                t = wm.to_megatron(p, [src.get(n) for n in p.hf_names], model)
            bar.update(t.numel() * t.element_size())
            return t.reshape(s.sizes).to(s.dtype)

        record = {
            "direction": "hf-to-megatron",
            "source": str(hf_dir.resolve()),
            "source_architecture": hf.get("architectures"),
            "layout": layout,
            "model_config": model,
            "dtype": sorted({DTYPE_NAMES[d] for d in dtypes.values()}),
            "toolkit_version": toolkit_version(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hf_tensors": len({n for p in pieces for n in p.hf_names}),
            "megatron_chunks": len(slices),
        }
        record.update(source or {})
        hint = (f"python launch.py 'hydra.searchpath=[file://{out_dir.resolve()}]' model={model['name']} "
                f"checkpoint.load={out_dir.resolve()}")
        common = {
            "step": 0, "weights_only": True, "model": model["name"], "model_config": model,
            "layout": layout, "seed": None, "scheduler": None, "distributed_optimizer": False,
            "converted_from": {k: record[k] for k in ("source", "source_architecture", "toolkit_version")},
            "model_yaml_hint": hint,
        }
        (tmp / ITERATION).mkdir()
        write_checkpoint(tmp / ITERATION, slices, produce, common)
        (tmp / LATEST).write_text(ITERATION + "\n")
        (tmp / HF_SOURCE).mkdir()
        shutil.copy2(hf_dir / "config.json", tmp / HF_SOURCE / "config.json")
        for f in SIDE_FILES:
            if (hf_dir / f).is_file():
                shutil.copy2(hf_dir / f, tmp / HF_SOURCE / f)
        (tmp / "model").mkdir()
        (tmp / "model" / f"{model['name']}.yaml").write_text(_model_yaml(model))
        record["seconds"] = round(time.perf_counter() - start, 3)
        record["train_with"] = hint
        _finish(tmp, record, before_publish)
    return record


def _model_yaml(model: dict) -> str:
    from omegaconf import OmegaConf

    return "# Written by gridwright.adapters.convert: the model this checkpoint holds.\n" + OmegaConf.to_yaml(model)


# --- Megatron-Core -> Hugging Face -------------------------------------------------------


def _model_from_yaml(path: Path) -> dict:
    """A model config from a job's config.yaml or a conf/model file, schema defaults filled in."""
    from omegaconf import OmegaConf

    from ..config.schema import ModelConfig

    if not path.is_file():
        raise ConversionError(f"--model-config {path} does not exist.")
    loaded = OmegaConf.load(path)
    node = loaded.get("model", loaded)
    try:
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ModelConfig), node), resolve=True)
    except Exception as e:  # omegaconf's validation errors: a wrong key or type
        raise ConversionError(f"--model-config {path} is not a gridwright model config: {e}") from e


def plan_megatron_to_hf(reader: CheckpointReader, model: dict) -> list:
    """Check every checkpoint tensor against the map; return the pieces."""
    shapes = wm.global_shapes(model)
    problems = []
    for key, shape in shapes.items():
        if key not in reader.tensors:
            problems.append(f"missing tensor {key}")
        elif reader.shape(key) != shape:
            problems.append(f"{key} has shape {list(reader.shape(key))}, the model config implies {list(shape)}")
    unexpected = [k for k in reader.tensors if k not in shapes and not any(m in k for m in wm.MEGATRON_NOT_WEIGHTS)]
    if unexpected:
        problems.append(f"unexpected tensors, not mapped: {', '.join(sorted(unexpected)[:6])}")
    if problems:
        raise ConversionError(f"{reader.dir} does not match its model config:\n  - " + "\n  - ".join(problems))
    return wm.pieces(model)


def _hf_config(root: Path, model: dict, dtype: torch.dtype) -> tuple[dict, bool]:
    """(config.json, whether it is the source's own). The source's own when this checkpoint
    came from Hugging Face and still has exactly its model; else one written by
    transformers' config classes."""
    kept = root / HF_SOURCE
    if (kept / "config.json").is_file():
        original = json.loads((kept / "config.json").read_text())
        try:
            same = same_model(model_config_from_hf(read_hf_config(kept), model["name"]), model)
        except UnsupportedModel:
            same = False
        if same:
            return dict(original, dtype=DTYPE_NAMES[dtype]) if "dtype" in original else original, True
    return hf_config_from_model(model, DTYPE_NAMES[dtype]), False


def megatron_to_hf(megatron_dir, out_dir, model_config=None, dtype=None, overwrite=False,
                   max_shard_bytes=2 * 1024**3, before_publish=None) -> dict:
    """Convert; returns the record written to `out_dir/conversion.json` (`before_publish` as
    in hf_to_megatron)."""
    root, it = find_checkpoint(Path(megatron_dir))
    out_dir = Path(out_dir)
    try:
        reader = CheckpointReader(it)
    except UntrustedCheckpointFile:
        raise
    except Exception as e:  # a missing or corrupt .metadata or common.pt
        raise ConversionError(f"{it} is not a readable Megatron-Core checkpoint: {e}") from e
    model = _model_from_yaml(Path(model_config)) if model_config else reader.common.get("model_config")
    if not model:
        raise ConversionError(
            f"{it} does not record its model config (saved before gridwright recorded it). "
            "Fix: pass --model-config with the training job's config.yaml or a conf/model file."
        )
    pieces = plan_megatron_to_hf(reader, model)
    # Each tensor keeps its stored dtype unless --dtype casts them all.
    key_dtype = {p.key: dtype or reader.dtype(p.key) for p in pieces}
    hf_config, own_config = _hf_config(root, model, key_dtype[wm.EMBEDDING])
    total = sum(p.numel * key_dtype[p.key].itemsize for p in pieces)
    start = time.perf_counter()
    with staged_directory(out_dir, overwrite) as tmp, _progress(total, "megatron->hf") as bar:
        entries = [(name, shape, key_dtype[p.key]) for p in pieces
                   for name, shape in zip(p.hf_names, wm.hf_shapes(p, model))]
        writer = StreamingSafetensorsWriter(tmp, entries, max_shard_bytes)
        shapes = wm.global_shapes(model)
        for p in pieces:  # one DCP read per piece (or row block): memory stays at one slice
            blocks = _export_slices(reader, p, shapes[p.key])
            for s in blocks:
                t = reader.read([s])[0]
                parts = [t.reshape(s.sizes)] if len(blocks) > 1 else wm.to_hf(p, t.reshape(p.shape), model)
                for name, part in zip(p.hf_names, parts):
                    writer.add(name, part.to(key_dtype[p.key]))
                bar.update(t.numel() * key_dtype[p.key].itemsize)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        # The source's tokenizer only goes with the source's own model (not after a resize).
        copied = [f for f in SIDE_FILES if own_config and (root / HF_SOURCE / f).is_file()]
        for f in copied:
            shutil.copy2(root / HF_SOURCE / f, tmp / f)
        record = {
            "direction": "megatron-to-hf",
            "source": str(it.resolve()),
            "source_layout": reader.common.get("layout"),
            "source_step": reader.common.get("step"),
            "model_config": model,
            "dtype": sorted({DTYPE_NAMES[d] for d in key_dtype.values()}),
            "config_json": "the source's own" if own_config else "written by transformers' config class",
            "copied_files": copied,
            "toolkit_version": toolkit_version(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hf_tensors": len(entries),
            "seconds": round(time.perf_counter() - start, 3),
        }
        _finish(tmp, record, before_publish)
    return record


def deepspeed_to_hf(ds_dir, out_dir, dtype=None, overwrite=False, max_shard_bytes=2 * 1024**3,
                    before_publish=None) -> dict:
    """A DeepSpeed engine checkpoint as a Hugging Face folder: its weights consolidated
    (deepspeed_files), checked against the names and shapes transformers builds for the
    recorded model, written with the config transformers writes for it."""
    import transformers

    try:
        it = find_deepspeed_checkpoint(Path(ds_dir))
    except NotADeepSpeedCheckpoint as e:
        raise ConversionError(str(e)) from e
    manifest = read_manifest(it)
    model = manifest["common"]["model_config"]
    config = transformers_config(model)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    start = time.perf_counter()
    weights = consolidated_weights(it)
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) + sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ConversionError(f"{it} does not hold the weights of its recorded model ({len(wrong)} names or "
                              f"shapes differ, e.g. {', '.join(wrong[:4])}).")
    out_dtype = dtype or next(iter(weights.values())).dtype
    out_dir = Path(out_dir)
    with staged_directory(out_dir, overwrite) as tmp:
        entries = [(name, got[name], out_dtype) for name in sorted(weights)]
        writer = StreamingSafetensorsWriter(tmp, entries, max_shard_bytes)
        for name, _, _ in entries:
            writer.add(name, weights[name].to(out_dtype))
        writer.finish()
        (tmp / "config.json").write_text(
            json.dumps(hf_config_from_model(model, DTYPE_NAMES[out_dtype]), indent=2, sort_keys=True) + "\n")
        record = {
            "direction": "deepspeed-to-hf",
            "source": str(it.resolve()),
            "source_settings": manifest["common"]["settings"],
            "source_step": manifest["common"]["step"],
            "model_config": model,
            "dtype": [DTYPE_NAMES[out_dtype]],
            "config_json": "written by transformers' config class",
            "toolkit_version": toolkit_version(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hf_tensors": len(entries),
            "seconds": round(time.perf_counter() - start, 3),
        }
        _finish(tmp, record, before_publish)
    return record


def deepspeed_to_megatron(ds_dir, out_dir, tp=1, pp=1, vpp=None, ep=1, name=None, dtype=None, overwrite=False,
                          check_hf=None, before_publish=None) -> dict:
    """DeepSpeed -> Hugging Face (a temporary folder, checked by `check_hf` like
    deepspeed_to_hf's output) -> Megatron-Core, by the two converters that exist. The
    record names the DeepSpeed checkpoint as the source."""
    try:
        it = find_deepspeed_checkpoint(Path(ds_dir))
    except NotADeepSpeedCheckpoint as e:
        raise ConversionError(str(e)) from e
    model_name = name or read_manifest(it)["common"]["model_config"]["name"]
    with scratch_directory(out_dir) as tmp:
        hf_dir = tmp / "hf"
        first = deepspeed_to_hf(it, hf_dir, before_publish=check_hf)

        def check(staged: Path, record: dict):
            out = {"deepspeed_to_hf": first.get("verify")}
            if before_publish is not None:
                out["hf_to_megatron"] = before_publish(staged, record, hf_dir)
            return out

        return hf_to_megatron(hf_dir, out_dir, tp, pp, vpp, ep, model_name, dtype, overwrite, before_publish=check,
                              source={"direction": "deepspeed-to-megatron", "source": str(it.resolve()),
                                      "source_step": first["source_step"], "via": "a temporary Hugging Face folder"})


def _finish(staged: Path, record: dict, before_publish) -> None:
    """Run the check on the staged output (its result goes into the record), then write the record."""
    if before_publish is not None:
        record["verify"] = before_publish(staged, record)
    (staged / RECORD).write_text(json.dumps(record, indent=2) + "\n")


class VerificationFailed(RuntimeError):
    """The converted model's logits differ from the source's: nothing was published."""


# --- command line ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gridwright.adapters.convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="Hugging Face folder -> Megatron-Core distributed checkpoint")
    a.add_argument("--hf", required=True, help="folder with config.json and (sharded) safetensors")
    b = sub.add_parser("megatron-to-hf", help="Megatron-Core distributed checkpoint -> Hugging Face folder")
    b.add_argument("--megatron", required=True, help="checkpoint root (with 'latest') or one iter_N directory")
    b.add_argument("--model-config", help="model config YAML (a job's config.yaml or conf/model file), for "
                   "checkpoints that do not record theirs")
    c = sub.add_parser("deepspeed-to-hf", help="DeepSpeed engine checkpoint -> Hugging Face folder")
    d = sub.add_parser("deepspeed-to-megatron", help="DeepSpeed engine checkpoint -> Megatron-Core checkpoint")
    for p in (c, d):
        p.add_argument("--deepspeed", required=True, help="checkpoint root (with 'latest') or one iter_N directory")
    for p in (a, d):
        p.add_argument("--name", help="model name recorded in the checkpoint (default: the source's)")
        for opt in ("--tp", "--pp", "--ep"):
            p.add_argument(opt, type=int, default=1, help=f"target {opt[2:].upper()} (validated, recorded, verified)")
        p.add_argument("--vpp", type=int, default=None, help="target virtual pipeline stages per rank")
    for p in (b, c, d):
        p.add_argument(TRUST_FLAG, action="store_true", help="read the checkpoint's pickled files with full pickle, "
                       "which can run code they carry (default: an allowlist; only for a checkpoint you trust)")
    for p in (b, c):
        p.add_argument("--max-shard-gib", type=float, default=2.0, help="largest safetensors file")
    for p in (a, b, c, d):
        p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
        p.add_argument("--dtype", choices=sorted(DTYPES), help="cast to this dtype (default: keep the source's)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output (atomically)")
        p.add_argument("--verify", action="store_true", help="compare the output's logits with the source's")
        p.add_argument("--tolerance", type=float, default=1e-4, help="--verify: largest allowed |logit diff| (fp32 compute; with --dtype, both sides' weights are rounded to it first)")
    b.add_argument("--tp", type=int, default=1, help="--verify: layout to load the Megatron-Core side at")
    b.add_argument("--pp", type=int, default=1)
    b.add_argument("--ep", type=int, default=1)
    b.add_argument("--vpp", type=int, default=None)
    return ap


def _verifier(args, direction: str):
    """The --verify check of a Hugging Face folder against a Megatron-Core checkpoint, run
    on the staged output before it is published (`hf_dir` names the Hugging Face side
    when it is neither the source nor the output)."""
    from .verify_logits import compare_logits

    def verify(staged: Path, record: dict, hf_dir: Path | None = None) -> dict:
        if direction == "megatron-to-hf":
            hf_dir, megatron_dir = staged, Path(args.megatron)
        else:
            hf_dir, megatron_dir = hf_dir or Path(args.hf), staged
        try:
            result = compare_logits(hf_dir, megatron_dir, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                                    model=record["model_config"], round_to=args.dtype, progress=True)
        except (RuntimeError, OSError) as e:  # e.g. the Megatron-Core logits processes failed
            raise VerificationFailed(f"the verification could not run ({type(e).__name__}: {str(e)[-1500:]}); "
                                     f"nothing was written to {args.out}.") from e
        result["tolerance"] = args.tolerance
        ok = result["max_abs_diff"] <= args.tolerance
        print(f"verify: max |logit diff| {result['max_abs_diff']:.3e} at TP={args.tp} PP={args.pp} EP={args.ep} "
              f"({'ok' if ok else 'FAILED'}, tolerance {args.tolerance:g}; weights {result['weights']})", flush=True)
        if not ok:
            raise VerificationFailed(
                f"the converted model's logits differ from the source's by {result['max_abs_diff']:.3e} "
                f"(tolerance {args.tolerance:g}); nothing was written to {args.out}.")
        return result

    return verify


def _digest_verifier(args):
    """The --verify check of a Hugging Face folder made from a DeepSpeed checkpoint: its
    logits (transformers, fp32 compute) against the digest the training engine took of
    its own model when it saved (in the training precision)."""
    from ..checkpoints.logits_digest import digest, digest_difference, sample_tokens
    from ..planning.disk_space import size_text
    from .verify_logits import ROUNDING, hf_logits, stage, weights_bytes

    def verify(staged: Path, record: dict) -> dict:
        manifest = read_manifest(Path(record["source"]))
        want = manifest["logits_digest"]
        tokens = sample_tokens(want["vocab_size"], *want["tokens"])
        with stage(f"Hugging Face side: {size_text(weights_bytes(staged))} of weights into transformers, forward "
                   f"on {tokens.shape[0]} x {tokens.shape[1]} tokens, against the digest saved with the checkpoint",
                   True):
            logits = hf_logits(staged, tokens, ROUNDING.get(args.dtype))
        diff = digest_difference(digest(logits), want)
        precision = manifest["common"]["settings"]["params_dtype"]
        ok = diff <= args.tolerance
        print(f"verify: max |logit diff| {diff:.3e} against the DeepSpeed engine's own forward at save "
              f"({precision}) ({'ok' if ok else 'FAILED'}, tolerance {args.tolerance:g})", flush=True)
        if not ok:
            hint = (f" The run trained in {precision}: its forward differs from an fp32 one by the rounding; "
                    "raise --tolerance to that." if precision != "fp32" else "")
            raise VerificationFailed(
                f"the consolidated model's logits differ from the saved model's by {diff:.3e} (tolerance "
                f"{args.tolerance:g}); nothing was written to {args.out}.{hint}")
        return {"max_abs_diff": diff, "tolerance": args.tolerance,
                "against": f"logits digest of the DeepSpeed engine's forward at save ({precision})"}

    return verify


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    filter_known_warnings("cpu")  # the converter runs on the CPU: DeepSpeed's warning that it found no GPU
    guard_process(trust=getattr(args, "trust_pickled_code", False))  # before any checkpoint file is read
    untested = megatron_core_refusal() or torch_refusal()
    if not untested and args.direction.startswith("deepspeed-"):
        from ..versions.deepspeed_version import refusal as deepspeed_refusal

        untested = deepspeed_refusal()
    if untested:
        print(f"error: {untested}", file=sys.stderr)
        return EXIT_INVALID
    dtype = DTYPES[args.dtype] if args.dtype else None
    check = None
    if args.verify:
        check = _digest_verifier(args) if args.direction == "deepspeed-to-hf" else _verifier(args, args.direction)
    problem = unwritable_reason(args.out)
    if problem:
        print(f"error: cannot write --out {args.out}: {problem}.", file=sys.stderr)
        return EXIT_INVALID
    for path in remove_stale_stages(args.out):
        print(f"removed {path}: left by a conversion that was killed", file=sys.stderr)
    try:
        if args.direction == "hf-to-megatron":
            record = hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.vpp, args.ep, args.name, dtype,
                                    args.overwrite, before_publish=check)
        elif args.direction == "megatron-to-hf":
            record = megatron_to_hf(args.megatron, args.out, args.model_config, dtype, args.overwrite,
                                    int(args.max_shard_gib * 1024**3), before_publish=check)
        elif args.direction == "deepspeed-to-hf":
            record = deepspeed_to_hf(args.deepspeed, args.out, dtype, args.overwrite,
                                     int(args.max_shard_gib * 1024**3), before_publish=check)
        else:
            record = deepspeed_to_megatron(args.deepspeed, args.out, args.tp, args.pp, args.vpp, args.ep, args.name,
                                           dtype, args.overwrite, check_hf=_digest_verifier(args) if check else None,
                                           before_publish=check)
    except (ValueError, FileExistsError, UntrustedCheckpointFile) as e:  # bad input (ConversionError, ...)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    except VerificationFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk filled, a file vanished: say so in one line
        print(f"error: {e.strerror or e} ({e.filename or args.out}); nothing was written to {args.out}.",
              file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {record['hf_tensors']} Hugging Face tensors in {record['seconds']} s"
          + (" (verified before it was published)" if args.verify else ""))
    if record.get("train_with"):
        print(f"train from it: {record['train_with']}")
    return 0


if __name__ == "__main__":
    from gridwright.basics.process_exit import exit_without_final_collection

    exit_without_final_collection(main())
