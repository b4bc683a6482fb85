"""Tiny random Hugging Face models of every architecture the converter supports (each
family declaration names its own, in `tiny`).

Made locally by `transformers` (no hub access) and saved with `save_pretrained`, so the
files are exactly what a user's folder holds. The tests and the conversion check
(evaluations/verify_conversions.py) use them; they also let a user try the converter
without downloading anything:

    python -m gridwright.adapters.tiny_models mixtral /tmp/tiny_mixtral
"""
from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _configs():
    """Every tiny model of every declared family, as its transformers config object."""
    import transformers

    from ..families.registry import FAMILIES

    return {name: getattr(transformers, fam.hf_config_class)(**dict(SHAPE, **extra))
            for fam in FAMILIES.values() for name, extra in fam.tiny.items()}


ARCHITECTURES = tuple(_configs())


def has_experts(kind: str) -> bool:
    """Whether the tiny model `kind` is a mixture of experts (its family says)."""
    from ..families.registry import FAMILIES

    return next(fam.experts for fam in FAMILIES.values() if kind in fam.tiny)


def make_tiny_model(kind: str, out: Path, dtype=torch.float32, seed: int = 0, shard_size: str | None = None) -> Path:
    """Save a randomly initialised model of `kind` to `out`; biases and norms are randomised
    too, so a mapping that swapped or dropped them would show in the logits."""
    import transformers

    torch.manual_seed(seed)
    config = _configs()[kind]
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger than the usual 0.02 init, so logits are O(1) and differences show
        for name, p in model.named_parameters():
            p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1 if "norm" in name or name.endswith("bias") else 0.08)
    model.to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    transformers.utils.logging.disable_progress_bar()  # a bar for a write of a few hundred KiB
    model.save_pretrained(out, **kwargs)
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in ARCHITECTURES:
        sys.exit(f"usage: python -m gridwright.adapters.tiny_models {{{'|'.join(ARCHITECTURES)}}} OUT_DIR")
    print(make_tiny_model(sys.argv[1], Path(sys.argv[2])))
