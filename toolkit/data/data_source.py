"""Where a run's micro-batches come from: synthetic tokens or prepared indexed datasets.

Either way, micro-batch k of DP rank r at step s holds the global samples
s*G + r*M*B + k*B ... + B-1 (G global batch, M micro-batches, B micro-batch size), so the
data position is a function of the step alone: a resumed run, on any layout, sees
exactly the samples the uninterrupted one would.

Importing this module does not import torch: validation reads a prepared dataset's index
through it (`expected_bin_bytes`) to refuse a truncated .bin before anything starts.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .device_copy import to_device

# Megatron-Core's .idx layout (megatron.core.datasets.indexed_dataset._IndexWriter): a
# 9-byte magic, version 1 (<Q), the token dtype's code (<B), the sequence and document
# counts (<Q each), then int32 sequence lengths and int64 byte pointers into the .bin.
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = struct.Struct("<9sQBQQ")
IDX_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # indexed_dataset.DType codes


def expected_bin_bytes(prefix: str) -> int:
    """The size the .idx says `prefix`.bin has: the last sequence's pointer plus its length
    in tokens times the token size. Reads the header and two numbers, not the index.
    Raises ValueError for a file that is not a Megatron-Core index."""
    idx = prefix + ".idx"
    with open(idx, "rb") as f:
        head = f.read(IDX_HEADER.size)
        if len(head) < IDX_HEADER.size:
            raise ValueError(f"{idx} is {len(head)} bytes, shorter than a Megatron-Core index header")
        magic, version, code, sequences, _documents = IDX_HEADER.unpack(head)
        if magic != IDX_MAGIC or version != 1 or code not in IDX_DTYPE_SIZES:
            raise ValueError(f"{idx} is not a Megatron-Core index (header {head[:9]!r}, version {version}, dtype code {code})")
        if sequences == 0:
            return 0
        lengths = np.fromfile(f, dtype="<i4", count=sequences)
        pointers = np.fromfile(f, dtype="<i8", count=sequences)
    if len(lengths) < sequences or len(pointers) < sequences:
        raise ValueError(f"{idx} is truncated: its header counts {sequences} sequences")
    return int(pointers[-1]) + int(lengths[-1]) * IDX_DTYPE_SIZES[code]


class SyntheticSource:
    def __init__(self, train, model):
        self.train, self.vocab_size = train, model.vocab_size

    def batches(self, split: str, index: int, dp_rank: int, dp_size: int, num_micro: int, device):
        from . import synthetic_data  # imports torch, which validation (importing this module) does not

        t = self.train
        return synthetic_data.micro_batches(index, dp_rank, dp_size, num_micro, t.micro_batch_size,
                                            t.seq_length, self.vocab_size, _seed(t, split), device)


def _seed(train, split: str) -> int:
    return train.seed if split == "train" else train.seed + 10**6  # held-out stream for validation


class PackedSource:
    """Packed variable-length rows (`data.packing`), of either kind: each micro-batch is
    its rows' documents in one THD sequence (`packing.pack`), padded per document to a
    multiple of `pad_multiple`. Row numbering is the unpacked layout's, so the data
    position is still a function of the step alone."""

    def __init__(self, rows, train, pad_multiple: int):
        self.rows, self.train, self.pad_multiple = rows, train, pad_multiple

    def batches(self, split: str, index: int, dp_rank: int, dp_size: int, num_micro: int, device):
        from .packing import pack

        b = self.train.micro_batch_size
        base = index * num_micro * b * dp_size + dp_rank * num_micro * b
        for mb in range(num_micro):
            docs = [d for i in range(b) for d in self.rows(split, base + mb * b + i)]
            yield pack(docs, self.pad_multiple, device)

    def global_documents(self, split: str, index: int) -> list:
        """Every document of global batch `index`, in row order (dynamic CP schedules them)."""
        g = self.train.global_batch_size
        return [d for i in range(index * g, (index + 1) * g) for d in self.rows(split, i)]


class _TokenizerInfo:
    """The three facts Megatron-Core's GPT dataset needs from a tokenizer."""

    def __init__(self, info: dict):
        self.vocab_size, self.eod, self.pad = info["vocab_size"], info["eod"], info["pad"]
        # Part of the dataset cache key, so a cache built for another tokenizer is not reused.
        self.unique_identifiers = {"tokenizer": info["tokenizer"], "vocab_size": self.vocab_size, "eod": self.eod}


class IndexedSource:
    """Megatron-Core's GPTDataset over .bin/.idx files, blended and split by its builder."""

    def __init__(self, data, train, cache_dir: Path):
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        from .prepare_data import dataset_info

        self.micro_batch_size = train.micro_batch_size
        d, t = data, train
        info = dataset_info(d.paths[0])
        self.eod = info["eod"]
        evals = (t.steps // d.eval_interval + 1) if d.eval_interval else 0
        sizes = [t.steps * t.global_batch_size, evals * d.eval_iters * t.global_batch_size, 0]
        config = GPTDatasetConfig(
            random_seed=t.seed,
            sequence_length=t.seq_length,
            blend=(list(d.paths), list(d.weights) if d.weights else None),
            split=d.split.replace("/", ","),  # "/" lets the split pass Hydra's command line
            tokenizer=_TokenizerInfo(info),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            path_to_cache=str(cache_dir),
        )
        self.train, self.valid, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, config
        ).build()

    def batches(self, split: str, index: int, dp_rank: int, dp_size: int, num_micro: int, device):
        import torch

        b = self.micro_batch_size
        dataset = self.train if split == "train" else self.valid
        base = index * num_micro * b * dp_size + dp_rank * num_micro * b
        for mb in range(num_micro):
            items = [dataset[base + mb * b + j] for j in range(b)]
            yield {
                key: to_device(torch.stack([torch.as_tensor(it[key]) for it in items]), device)
                for key in ("tokens", "labels", "loss_mask", "position_ids")
            }


    def rows(self, split: str, index: int) -> list:
        """Sample `index` of `split` cut into its documents at the EOD tokens."""
        from .packing import split_at_eod

        item = (self.train if split == "train" else self.valid)[index]
        return split_at_eod(np.asarray(item["tokens"]), np.asarray(item["labels"]),
                            np.asarray(item["loss_mask"]), self.eod)


def make_source(data, train, model, cache_dir: Path, pad_multiple: int = 1):
    """The run's micro-batches: `data.kind` picks the source; `model` sizes synthetic tokens;
    with `data.packing`, rows of whole documents padded to `pad_multiple` (PackedSource)."""
    if not data.packing:
        return IndexedSource(data, train, cache_dir) if data.kind == "indexed" else SyntheticSource(train, model)
    if data.kind == "indexed":
        return PackedSource(IndexedSource(data, train, cache_dir).rows, train, pad_multiple)
    from .packing import synthetic_row

    def rows(split, index):
        return synthetic_row(index, train.seq_length, model.vocab_size, _seed(train, split), data.doc_lengths)

    return PackedSource(rows, train, pad_multiple)
