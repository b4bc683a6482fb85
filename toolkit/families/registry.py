"""The supported families. Adding one is a declaration file plus its line here."""
from __future__ import annotations

from . import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from .declaration import Family, UnsupportedModel

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, mixtral.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise UnsupportedModel(f"model family '{name}' is not supported; supported: {', '.join(sorted(FAMILIES))}.")
    return FAMILIES[name]
