"""The one table between Hugging Face tensor names and Megatron-Core checkpoint tensors.

Both conversion directions walk the same list of `Piece`s, so what one direction writes
the other reads back. A piece is one slice of a Megatron-Core sharded tensor (a whole
tensor, one layer of a stacked one, or one expert of one layer) together with the
Hugging Face tensors it is made of and how they combine:

    copy   one tensor, unchanged
    cat    concatenated along dim 0 (SwiGLU's gate and up projections -> linear_fc1)
    qkv    q, k, v regrouped per key/value group: [q heads of group 0, k0, v0, q heads of
           group 1, k1, v1, ...], the row order of Megatron-Core's fused linear_qkv
           (SelfAttention.get_query_key_value_tensors splits it that way)

Megatron-Core keys are those of the local (and TE) layer spec in a distributed
checkpoint: layers are stacked on a leading axis (global layer index), experts on a
second one, which is what makes the checkpoint independent of TP/PP/EP. Hugging Face's
Llama rotary embedding (rotate_half) equals Megatron-Core's non-interleaved one, so no
rotary permutation is needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Megatron-Core checkpoint keys (local/TE spec names; see megatron_model.layer_spec).
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
LAYER = "decoder.layers."
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
    combine: str  # copy | cat | qkv

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _qkv_sizes(model: dict) -> tuple[int, int, int]:
    heads, groups = model["num_attention_heads"], model["num_query_groups"]
    return groups, heads // groups, model["hidden_size"] // heads  # groups, q heads per group, head dim


def pieces(model: dict) -> list[Piece]:
    """Every Megatron-Core tensor slice of a gridwright model config, in file order."""
    h, f, L = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    v, experts = model["vocab_size"], model.get("num_experts") or 0
    groups, per_group, d = _qkv_sizes(model)
    qkv_rows = groups * (per_group + 2) * d
    out = [Piece(EMBEDDING, (), (v, h), ("model.embed_tokens.weight",), "copy")]
    for layer in range(L):
        hf = f"model.layers.{layer}."
        at = (layer,)
        attn = [
            Piece(LAYER + "self_attention.linear_qkv.layer_norm_weight", at, (h,), (hf + "input_layernorm.weight",), "copy"),
            Piece(LAYER + "self_attention.linear_qkv.weight", at, (qkv_rows, h),
                  tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
        ]
        if model.get("qkv_bias"):
            attn.append(Piece(LAYER + "self_attention.linear_qkv.bias", at, (qkv_rows,),
                              tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"))
        attn += [
            Piece(LAYER + "self_attention.linear_proj.weight", at, (h, h), (hf + "self_attn.o_proj.weight",), "copy"),
            Piece(LAYER + "mlp.linear_fc1.layer_norm_weight", at, (h,), (hf + "post_attention_layernorm.weight",), "copy"),
        ]
        out += attn
        if experts:
            moe = hf + "block_sparse_moe."
            out.append(Piece(LAYER + "mlp.router.weight", at, (experts, h), (moe + "gate.weight",), "copy"))
            for e in range(experts):
                ex = f"{moe}experts.{e}."
                out += [
                    Piece(LAYER + "mlp.experts.experts.linear_fc1.weight", (layer, e), (2 * f, h),
                          (ex + "w1.weight", ex + "w3.weight"), "cat"),
                    Piece(LAYER + "mlp.experts.experts.linear_fc2.weight", (layer, e), (h, f), (ex + "w2.weight",), "copy"),
                ]
        else:
            out += [
                Piece(LAYER + "mlp.linear_fc1.weight", at, (2 * f, h),
                      (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "cat"),
                Piece(LAYER + "mlp.linear_fc2.weight", at, (h, f), (hf + "mlp.down_proj.weight",), "copy"),
            ]
    out.append(Piece(FINAL_NORM, (), (h,), ("model.norm.weight",), "copy"))
    if not model["tie_embeddings"]:  # tied: Megatron-Core keeps only the embedding
        out.append(Piece(OUTPUT, (), (v, h), ("lm_head.weight",), "copy"))
    return out


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
    elif piece.combine == "cat":
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
    if piece.combine == "cat":
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
    if piece.combine == "cat":
        return [(piece.shape[0] // 2, *piece.shape[1:])] * 2
    groups, per_group, d = _qkv_sizes(model)
    rest = piece.shape[1:]
    return [(groups * per_group * d, *rest), (groups * d, *rest), (groups * d, *rest)]
