"""A fingerprint of a model's logits, small enough to keep in a checkpoint's manifest.

A checkpoint whose weights are spread over optimizer partitions (DeepSpeed ZeRO) is
consolidated before it becomes a Hugging Face folder; the digest, taken by the training
engine's own forward when it saved, is what the consolidated model must reproduce
(`convert --verify`). It keeps, on fixed random tokens, each position's log-sum-exp over
the whole vocabulary (every logit moves it) and the first few logits themselves.
"""
from __future__ import annotations

import torch

HEAD = 8  # logits kept per position, besides the log-sum-exp over all of them


def sample_tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """The fixed random tokens every logits check uses."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def digest(logits: torch.Tensor) -> dict:
    """The fingerprint of logits computed on `sample_tokens(vocab_size)`."""
    logits = logits.detach().float().cpu()
    return {"tokens": list(logits.shape[:2]), "vocab_size": logits.shape[-1],
            "logsumexp": torch.logsumexp(logits, dim=-1).flatten().tolist(),
            "head": logits[..., :HEAD].flatten().tolist()}


def digest_difference(a: dict, b: dict) -> float:
    """The largest |difference| between two fingerprints' values (inf if their shapes differ)."""
    if a["tokens"] != b["tokens"] or a["vocab_size"] != b["vocab_size"]:
        return float("inf")
    diffs = [abs(x - y) for k in ("logsumexp", "head") for x, y in zip(a[k], b[k])]
    return max(diffs)
