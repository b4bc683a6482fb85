"""Packed variable-length documents: a sample is a row of `seq_length` tokens holding whole
documents, and `cu_seqlens` says where each one starts. Attention stays inside a document,
positions restart at each, and the loss is per token, so a step's loss does not depend on
how documents were packed or split over ranks.

The synthetic source draws document lengths from a named long-tailed distribution (a
lognormal with a cap), each document an arithmetic sequence of its own (start and stride,
as `synthetic_data`), so long-document benchmarks and tests need no download. Row i is a
function of (seed, i) alone: a resumed run, on any layout, sees the same documents.

A document never leaks into another: its last token predicts nothing (loss mask 0 on the
position whose label would be the next document's first token).

Importing this module imports numpy only; `packed_micro_batch` and friends import torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .device_copy import to_device


@dataclass(frozen=True)
class Document:
    """One document of a packed row: `tokens` are the inputs, `labels` the next tokens,
    `loss_mask` 1 where the label belongs to the same document."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


def longest_document(lengths, seq_length: int) -> int:
    """The longest document `lengths` (data.doc_lengths) can draw: its cap, and never more
    than a row."""
    return min(lengths.cap or seq_length, seq_length)


def document_lengths(rng: np.random.Generator, lengths, seq_length: int) -> list[int]:
    """Lengths of the documents of one row, in order, summing to `seq_length`: drawn from
    `lengths` (data.doc_lengths) until the row is full; the last one is cut to fit."""
    cap = longest_document(lengths, seq_length)
    out, left = [], seq_length
    while left > 0:
        if lengths.distribution == "lognormal":
            n = int(round(rng.lognormal(np.log(lengths.median), lengths.sigma)))
        else:  # "fixed": every document `median` tokens (a check that packing changes nothing)
            n = int(lengths.median)
        n = max(lengths.min, min(cap, n))
        out.append(min(n, left))
        left -= out[-1]
    return out


def synthetic_row(index: int, seq_length: int, vocab_size: int, seed: int, lengths) -> list[Document]:
    """Packed row `index` of the synthetic variable-length stream."""
    rng = np.random.default_rng([seed, index])
    docs = []
    for n in document_lengths(rng, lengths, seq_length):
        start, stride = rng.integers(vocab_size), rng.integers(1, 8)
        seq = (start + stride * np.arange(n + 1)) % vocab_size
        mask = np.ones(n, dtype=np.float32)
        docs.append(Document(seq[:-1], seq[1:], mask))
    return docs


def split_at_eod(tokens: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, eod: int) -> list[Document]:
    """A GPTDataset sample cut into its documents: each ends with its EOD token, whose
    label (the next document's first token) is masked."""
    ends = list(np.flatnonzero(tokens == eod) + 1)
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    docs, start = [], 0
    for end in ends:
        mask = np.asarray(loss_mask[start:end], dtype=np.float32).copy()
        if tokens[end - 1] == eod:
            mask[-1] = 0.0
        docs.append(Document(tokens[start:end], labels[start:end], mask))
        start = end
    return docs


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack(docs: list[Document], multiple: int = 1, device=None) -> dict:
    """Documents -> one THD micro-batch ([1, T] tensors and `cu_seqlens`). Each document is
    padded at its end to a multiple of `multiple` (2·CP: context parallelism splits every
    document into 2·CP chunks); padding is masked, and causal attention keeps real tokens
    from seeing it, so it changes no loss."""
    import torch

    lens = [len(d) for d in docs]
    padded = [padded_length(n, multiple) for n in lens]
    total = sum(padded)
    tokens = np.zeros(total, dtype=np.int64)
    labels = np.zeros(total, dtype=np.int64)
    mask = np.zeros(total, dtype=np.float32)
    positions = np.zeros(total, dtype=np.int64)
    at = 0
    for d, n, p in zip(docs, lens, padded):
        tokens[at:at + n], labels[at:at + n], mask[at:at + n] = d.tokens, d.labels, d.loss_mask
        positions[at:at + p] = np.arange(p)
        at += p
    cu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    as_tensor = lambda a: to_device(torch.from_numpy(a).unsqueeze(0), device)  # noqa: E731
    return {
        "tokens": as_tensor(tokens),
        "labels": as_tensor(labels),
        "loss_mask": as_tensor(mask),
        "position_ids": as_tensor(positions),
        "cu_seqlens": torch.from_numpy(cu),  # on the host (torch_attention.thd_params)
        "max_seqlen": max(padded),
    }


def mean_context(lengths) -> float:
    """The mean context a token of documents of these lengths attends over: sum of length²
    / sum of length (a row of one document: its length; of many short ones: far less)."""
    lengths = list(lengths)
    return sum(n * n for n in lengths) / sum(lengths)


def histogram(values) -> dict[int, int]:
    """{value: count}, sorted by value."""
    out: dict[int, int] = {}
    for v in values:
        out[int(v)] = out.get(int(v), 0) + 1
    return dict(sorted(out.items()))
