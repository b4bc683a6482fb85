"""The rules of the data: indexed datasets that exist, are whole and fit the model's
vocabulary, and splits that give each nonzero share a document.
"""
from __future__ import annotations

import math
import os
from .fix_advice import fix_text


def check_data(data, model, parallel, launcher) -> list[str]:
    from ..data.data_source import expected_bin_bytes
    from ..data.prepare_data import dataset_info

    d, out = data, []
    if d.kind not in ("synthetic", "indexed"):
        return [f"data.kind='{d.kind}' is not one of synthetic, indexed."]
    if d.eval_interval < 0 or d.eval_iters < 1:
        out.append(f"data.eval_interval={d.eval_interval} must be >= 0 and data.eval_iters={d.eval_iters} >= 1.")
    if d.kind == "synthetic":
        return out
    if not d.paths:
        return out + ["data.kind=indexed needs data.paths (prefixes made by gridwright.data.prepare_data)."]
    if d.weights is not None and len(d.weights) != len(d.paths):
        out.append(f"data.weights has {len(d.weights)} entries for {len(d.paths)} data.paths.")
    if launcher.name != "local":
        return out  # the files live on the cluster
    tokenizers = set()
    for prefix in d.paths:
        missing = [prefix + s for s in (".bin", ".idx") if not os.path.exists(prefix + s)]
        if missing:
            needed = _documents_needed(d.split)
            out.append(f"dataset files missing: {', '.join(missing)}"
                       + (f"; data.split='{d.split}' needs {needed} documents at least" if needed else "")
                       + f". Fix: python -m gridwright.data.prepare_data --input YOUR_TEXT.jsonl --output-prefix {prefix}")
            continue
        try:
            info = dataset_info(prefix)
            expected = expected_bin_bytes(prefix)
        except (OSError, ValueError) as e:
            out.append(str(e))
            continue
        size = os.path.getsize(prefix + ".bin")
        if size != expected:
            out.append(f"{prefix}.bin holds {size:,} bytes, but {prefix}.idx describes {expected:,}: the dataset is "
                       f"{'truncated' if size < expected else 'not the one its index was written for'}. "
                       f"Fix: {_remake_dataset(prefix, info)}")
            continue
        tokenizers.add(info["tokenizer"])
        out += _data_split_problems(prefix, info["documents"], d)
        if info["vocab_size"] > model.vocab_size:
            tp = max(1, parallel.tp)  # a multiple of TP (the embedding's split); TP<1 is refused elsewhere
            fitting = -(-info["vocab_size"] // tp) * tp
            out.append(
                f"{prefix} was tokenized with a vocabulary of {info['vocab_size']} ({info['tokenizer']}), larger "
                f"than model.vocab_size={model.vocab_size}. Fix: model.vocab_size={fitting}."
            )
    if len(tokenizers) > 1:
        out.append(f"data.paths were made with different tokenizers: {sorted(tokenizers)}.")
    return out


def _remake_dataset(prefix: str, info: dict) -> str:
    """The commands that write `prefix` again from the inputs its .json records
    (prepare_data never overwrites, so the old files go first)."""
    from shlex import quote

    inputs = " ".join(quote(p) for p in info.get("inputs") or ["YOUR_TEXT.jsonl"])
    files = " ".join(quote(prefix + s) for s in (".bin", ".idx", ".json"))
    return (f"rm {files} && python -m gridwright.data.prepare_data --input {inputs} "
            f"--output-prefix {quote(prefix)} --tokenizer {quote(info.get('tokenizer', 'byte'))}")


def _documents_needed(split: str) -> int | None:
    """The fewest documents that give each nonzero share of `split` one (said before a
    dataset is prepared, so that preparing it does not fail on the split next); None for a
    split that does not parse (said where the dataset is read)."""
    try:
        shares = [float(x) for x in split.replace("/", ",").split(",")][:3]
    except ValueError:
        return None
    positive = [share for share in shares if share > 0]
    return max(math.ceil(sum(shares) / share - 1e-9) for share in positive) if positive else None


def _data_split_problems(prefix: str, documents: int, data) -> list[str]:
    """Each split with a nonzero share needs a document (Megatron-Core loops forever on an
    empty one). The Fix gives the starved validation and test shares 0 (and stops validation)."""
    split = data.split
    try:
        shares = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        return [f"data.split='{split}' must be comma-separated numbers, e.g. 98,2,0."]
    total = sum(shares)
    names = ("train", "validation", "test")
    starved = [i for i, share in enumerate(shares[:3]) if share > 0 and documents * share / total < 1]
    fix = {}
    if starved and 0 not in starved:
        fix["data.split"] = "/".join("0" if i in starved else f"{share:g}" for i, share in enumerate(shares))
        if 1 in starved and data.eval_interval:
            fix["data.eval_interval"] = 0
    return [
        f"{prefix} has {documents} documents: the {names[i]} share {shares[i]:g}/{total:g} of data.split='{split}' "
        "gets none. " + fix_text(fix, "more documents, or a share of 0 for that split.")
        for i in starved
    ]
