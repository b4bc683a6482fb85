"""Synthetic token stream with a learnable pattern, identical for every layout.

Sample i is an arithmetic sequence modulo the vocabulary (random start, stride 1..7,
drawn from `seed + i`): a model can predict each token from the two before it, so the
loss falls within a few steps, which makes "training works" a checkable fact. Every
rank derives its micro-batches from the global sample index, so TP=1 and TP=2 runs of
one seed see the same tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from .device_copy import to_device


def sample(index: int, seq_length: int, vocab_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + index)
    start = rng.integers(vocab_size)
    stride = rng.integers(1, 8)
    return (start + stride * np.arange(seq_length + 1)) % vocab_size


def micro_batches(step: int, dp_rank: int, dp_size: int, num_micro: int, micro_batch_size: int,
                  seq_length: int, vocab_size: int, seed: int, device):
    """Yield this DP rank's micro-batches of global step `step` as Megatron batch dicts."""
    global_batch = num_micro * micro_batch_size * dp_size
    base = step * global_batch + dp_rank * num_micro * micro_batch_size
    positions = torch.arange(seq_length, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    for mb in range(num_micro):
        first = base + mb * micro_batch_size
        rows = np.stack([sample(first + j, seq_length, vocab_size, seed) for j in range(micro_batch_size)])
        rows = to_device(torch.from_numpy(rows).long(), device)
        yield {
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_length, device=device),
            "position_ids": positions,
        }
