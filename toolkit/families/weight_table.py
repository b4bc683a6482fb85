"""A family's wildcard weight table expanded into the tensors of one model, both directions.

Both conversion directions walk the same list of `Piece`s, so what one direction writes
the other reads back. A piece is one slice of a Megatron-Core sharded tensor (a whole
tensor, one layer of a stacked one, or one expert of one layer) together with the
Hugging Face tensors it is made of and the named transform that combines them (see
declaration.py). Hugging Face's rotary embedding (rotate_half) equals Megatron-Core's
non-interleaved one, so no rotary permutation is needed.

The Megatron-Core side is the same for every family (the local and TE layer specs share
parameter names), so the shape of each Megatron-Core key is known here once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import family

EMBEDDING = "embedding.word_embeddings.weight"
# Hugging Face entries that are no weights: derived from config.json, accounted for.
HF_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
# Megatron-Core entries that are not model weights and are not exported.
MEGATRON_NOT_WEIGHTS = ("_extra_state", "optimizer.", "rng_state")


@dataclass(frozen=True)
class Piece:
    key: str  # Megatron-Core sharded-tensor key
    index: tuple[int, ...]  # position on the stacked axes: (), (layer,), (layer, expert)
    shape: tuple[int, ...]  # this piece's shape, without the stacked axes
    hf_names: tuple[str, ...]
    combine: str  # a transform of declaration.TRANSFORMS

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _qkv_sizes(model: dict) -> tuple[int, int, int]:
    heads, groups = model["num_attention_heads"], model["num_query_groups"]
    head_dim = model.get("head_dim") or model["hidden_size"] // heads
    return groups, heads // groups, head_dim  # groups, q heads per group, head dim


def megatron_shape(key: str, model: dict) -> tuple[int, ...]:
    """Shape of one layer's (or expert's) slice of a Megatron-Core tensor."""
    h, f, v = model["hidden_size"], model["ffn_hidden_size"], model["vocab_size"]
    groups, per_group, d = _qkv_sizes(model)
    qkv_rows = groups * (per_group + 2) * d
    suffix = key.removeprefix("decoder.layers.")
    shapes = {
        EMBEDDING: (v, h),
        "output_layer.weight": (v, h),
        "decoder.final_layernorm.weight": (h,),
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, groups * per_group * d),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * f, h),
        "mlp.linear_fc2.weight": (h, f),
        "mlp.router.weight": (model.get("num_experts") or 0, h),
        "mlp.experts.experts.linear_fc1.weight": (2 * f, h),
        "mlp.experts.experts.linear_fc2.weight": (h, f),
    }
    if suffix not in shapes:
        raise KeyError(f"{key}: no Megatron-Core shape is known for this key (add it to weight_table.megatron_shape)")
    return shapes[suffix]


def pieces(model: dict) -> list[Piece]:
    """Every Megatron-Core tensor slice of a gridwright model config, in file order: the
    rows before the first per-layer one, then layer by layer (its experts last, one by
    one), then the rows after."""
    rules = [r for r in family(model["family"]).weights if not (r.unless and model.get(r.unless))]
    experts = range(model.get("num_experts") or 0)
    start = next((i for i, r in enumerate(rules) if r.per_layer), len(rules))
    first = [r for r in rules[:start] if not r.per_layer]
    layered = [r for r in rules if r.per_layer]
    last = [r for r in rules[start:] if not r.per_layer]

    def piece(rule, index, **where) -> Piece:
        names = tuple(n.format(**where) for n in rule.hf_names)
        return Piece(rule.megatron, index, megatron_shape(rule.megatron, model), names, rule.transform)

    out = [piece(r, ()) for r in first]
    for layer in range(model["num_layers"]):
        out += [piece(r, (layer,), layer=layer) for r in layered if not r.per_expert]
        for e in experts:  # expert by expert, as Megatron-Core numbers them
            out += [piece(r, (layer, e), layer=layer, expert=e) for r in layered if r.per_expert]
    return out + [piece(r, ()) for r in last]


def tied_output_hf_name(model: dict) -> str:
    """The Hugging Face name of the output layer, which a tied model's file may still hold
    (a copy of the embedding): the family's row that tying drops."""
    rule = next(r for r in family(model["family"]).weights if r.megatron == "output_layer.weight")
    return rule.hf_names[0]


def global_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    """Megatron-Core key -> global shape (stacked axes first)."""
    L, experts = model["num_layers"], model.get("num_experts") or 0
    shapes = {}
    for p in pieces(model):
        stack = {0: (), 1: (L,), 2: (L, experts)}[len(p.index)]
        shapes[p.key] = stack + p.shape
    return shapes


def to_megatron(piece: Piece, tensors: list[torch.Tensor], model: dict) -> torch.Tensor:
    """Combine the Hugging Face tensors of one piece into its Megatron-Core slice."""
    if piece.combine == "copy":
        out = tensors[0]
    elif piece.combine == "gated_mlp":
        out = torch.cat(tensors, dim=0)
    else:
        groups, per_group, d = _qkv_sizes(model)
        q, k, v = tensors
        rest = q.shape[1:]
        out = torch.cat(
            [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
            dim=1,
        ).reshape(-1, *rest)
    if tuple(out.shape) != piece.shape:
        raise ValueError(
            f"{', '.join(piece.hf_names)}: shape {tuple(t.shape for t in tensors)} does not give "
            f"{piece.key}{list(piece.index)} of shape {piece.shape} (config.json disagrees with the weights)."
        )
    return out.contiguous()


def to_hf(piece: Piece, tensor: torch.Tensor, model: dict) -> list[torch.Tensor]:
    """Split one Megatron-Core slice into its Hugging Face tensors (inverse of to_megatron)."""
    if piece.combine == "copy":
        return [tensor]
    if piece.combine == "gated_mlp":
        half = tensor.shape[0] // 2
        return [tensor[:half].contiguous(), tensor[half:].contiguous()]
    groups, per_group, d = _qkv_sizes(model)
    rest = tensor.shape[1:]
    q, k, v = tensor.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def hf_shapes(piece: Piece, model: dict) -> list[tuple[int, ...]]:
    """The shape each Hugging Face tensor of `piece` must have (checked before converting)."""
    if piece.combine == "copy":
        return [piece.shape]
    if piece.combine == "gated_mlp":
        return [(piece.shape[0] // 2, *piece.shape[1:])] * 2
    groups, per_group, d = _qkv_sizes(model)
    rest = piece.shape[1:]
    return [(groups * per_group * d, *rest), (groups * d, *rest), (groups * d, *rest)]
