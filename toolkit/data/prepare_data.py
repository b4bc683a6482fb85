"""Tokenize JSONL or plain text into Megatron-Core's indexed dataset (.bin/.idx).

    python -m gridwright.data.prepare_data --input corpus.jsonl --output-prefix data/corpus \\
        [--tokenizer byte | --tokenizer /path/to/hf_tokenizer] [--json-key text]

JSONL: one document per line, its text under --json-key. Plain text (.txt): documents
are separated by blank lines. Every document ends with the tokenizer's end-of-document
token. The writer is Megatron-Core's own IndexedDatasetBuilder; the three outputs
(`.bin`, `.idx` and a `.json` that records the tokenizer) are written under temporary
names and renamed at the end, and existing outputs are never overwritten.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from ..basics.atomic_io import write_text_atomic
from .text_tokenizer import load_tokenizer

SUFFIXES = (".bin", ".idx", ".json")


def read_documents(path: Path, json_key: str):
    if path.suffix == ".jsonl":
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if json_key not in record:
                    raise ValueError(f"{path}:{n}: no key '{json_key}' (keys: {sorted(record)})")
                yield record[json_key]
    elif path.suffix == ".txt":
        block: list[str] = []
        with open(path) as f:
            for line in f:
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block)
                    block = []
        if block:
            yield "".join(block)
    else:
        raise ValueError(f"{path}: expected a .jsonl or .txt file")


def dataset_info(prefix: str | os.PathLike) -> dict:
    """What prepare_data recorded about a dataset (tokenizer, vocabulary, counts)."""
    path = Path(str(prefix) + ".json")
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {prefix} a dataset made by gridwright.data.prepare_data?")
    return json.loads(path.read_text())


def prepare(inputs: list[Path], prefix: Path, tokenizer_spec: str, json_key: str = "text") -> dict:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    for p in inputs:
        if not p.exists():
            raise FileNotFoundError(f"input {p} does not exist")
    existing = [str(prefix) + s for s in SUFFIXES if Path(str(prefix) + s).exists()]
    if existing:
        raise FileExistsError(f"{', '.join(existing)} already exist(s); gridwright never overwrites a dataset")
    tok = load_tokenizer(tokenizer_spec)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(prefix) + f".tmp{os.getpid()}")
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    builder = IndexedDatasetBuilder(str(tmp) + ".bin", dtype=dtype)
    documents = tokens = 0
    try:
        for path in inputs:
            for text in read_documents(path, json_key):
                ids = tok.encode(text) + [tok.eod]
                builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
                documents += 1
                tokens += len(ids)
        if documents == 0:
            raise ValueError(f"no documents in {', '.join(map(str, inputs))}")
        builder.finalize(str(tmp) + ".idx")
        info = {"tokenizer": tok.spec, "vocab_size": tok.vocab_size, "eod": tok.eod, "pad": tok.pad,
                "documents": documents, "tokens": tokens, "inputs": [str(p.resolve()) for p in inputs]}
        os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
        os.replace(str(tmp) + ".idx", str(prefix) + ".idx")
        write_text_atomic(str(prefix) + ".json", json.dumps(info, indent=1))
    finally:
        for s in (".bin", ".idx"):
            if Path(str(tmp) + s).exists():
                os.unlink(str(tmp) + s)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, nargs="+", type=Path)
    ap.add_argument("--output-prefix", required=True, type=Path)
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a folder with a Hugging Face tokenizer")
    ap.add_argument("--json-key", default="text")
    args = ap.parse_args(argv)
    try:
        info = prepare(args.input, args.output_prefix, args.tokenizer, args.json_key)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {info['documents']} documents, {info['tokens']} tokens, "
          f"vocabulary {info['vocab_size']} ({info['tokenizer']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
