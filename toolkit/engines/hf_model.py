"""The Hugging Face model the DeepSpeed engine trains: its transformers config, initial
weights (Megatron-Core's init rules, or a Hugging Face folder) and Megatron-Core's
load-balancing loss for mixtures of experts.

Every declared family builds here (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE): the
family's transformers class computes what its Megatron-Core declaration computes (Qwen2's
q/k/v biases are add_qkv_bias, Qwen3's q_norm/k_norm are qk_layernorm), which the
converter's logits checks and the DeepSpeed-against-Megatron runs test."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ..families.declaration import UnsupportedModel

# The Megatron-Core router settings under which the Hugging Face MoE classes route tokens
# as Megatron-Core does: softmax scores, plain top-k (no groups, expert bias, scaling,
# jitter, z-loss or capacity). Whether the chosen k are renormalised is checked apart:
# Megatron-Core's top-k-then-softmax (moe_router_pre_softmax=false, its default) is
# Hugging Face's renormalised top-k (Mixtral always, Qwen3-MoE with norm_topk_prob=true).
_HF_ROUTER = {"moe_router_score_function": "softmax", "moe_router_num_groups": None, "moe_router_group_topk": None,
              "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False,
              "moe_z_loss_coeff": None, "moe_input_jitter_eps": None, "moe_expert_capacity_factor": None}


@functools.lru_cache(maxsize=None)
def megatron_router(family_name: str) -> dict:
    """The MoE settings the Megatron engine's TransformerConfig gets for a family:
    Megatron-Core's defaults under the family's declared `megatron` arguments (the engine
    sets topk and the aux-loss coefficient from the model config on top)."""
    from megatron.core.transformer import TransformerConfig

    from ..families.registry import family

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.name.startswith("moe_")}
    return {**defaults, **{k: v for k, v in family(family_name).megatron.items() if k.startswith("moe_")}}


def router_problems(family_name: str, config) -> list[str]:
    """How the routing of transformers config `config` departs from the Megatron engine's
    for this family (empty: the same experts, weights and load-balancing loss)."""
    router = megatron_router(family_name)
    out = [f"Megatron-Core's {k}={router[k]!r}" for k, v in _HF_ROUTER.items() if router[k] != v]
    renormalised = bool(getattr(config, "norm_topk_prob", True))  # Mixtral's class always renormalises
    if router["moe_router_pre_softmax"] == renormalised:
        out.append(f"moe_router_pre_softmax={router['moe_router_pre_softmax']} against Hugging Face's "
                   f"norm_topk_prob={renormalised}")
    return out


def hf_config(model):
    """The transformers config of the same shape as gridwright's ModelConfig (the same one
    checkpoint export writes). A mixture of experts whose Megatron-Core router the Hugging
    Face class would not reproduce is refused here, before anything trains."""
    from omegaconf import OmegaConf

    from ..families.hf_config import transformers_config

    config = transformers_config(OmegaConf.to_container(model, resolve=True))
    problems = router_problems(model.family, config) if model.num_experts else []
    if problems:
        raise UnsupportedModel(f"engine=deepspeed cannot route the {model.family} family as the Megatron engine "
                               f"does: {'; '.join(problems)}.")
    return config


# Hugging Face names of the layers Megatron-Core initialises with its output-layer method
# (scaled by 1/sqrt(2 x layers)): the projections that write into the residual stream
# (experts fused in memory by transformers 5 name theirs `experts.down_proj`).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "down_proj", "w2.weight")


def _megatron_init(name: str, param, config):
    """Megatron-Core's initialiser of the Hugging Face parameter `name`."""
    if name.endswith("norm.weight"):  # RMSNorm scales, Qwen3's q_norm/k_norm (qk_layernorm) included
        return torch.nn.init.ones_
    if name.endswith(".bias"):  # Qwen2's q/k/v biases (add_qkv_bias): Megatron-Core starts them at zero
        return torch.nn.init.zeros_
    if "embed_tokens" in name:
        return config.embedding_init_method
    if name.endswith(_RESIDUAL_OUTPUTS):
        return config.output_layer_init_method
    if param.dim() >= 2:  # q/k/v, gate/up, router, experts' gate_up_proj, an untied lm_head
        return config.init_method
    raise UnsupportedModel(f"no Megatron-Core initialisation rule for the Hugging Face parameter {name}")


def initialise_as_megatron(model, cfg, layout) -> None:
    """Re-draw the weights with Megatron-Core's own initialisation rules (from the
    TransformerConfig the Megatron engine builds), so a default run of either engine starts
    from the same distribution: transformers draws N(0, 0.02) for every matrix, Megatron
    scales the residual-output projections down, and the curves differ for it."""
    from megatron.core.transformer import TransformerConfig

    from .megatron_model import transformer_config_kwargs

    config = TransformerConfig(**transformer_config_kwargs(cfg, layout))
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is the embedding, listed once
            _megatron_init(name, param, config)(param)


def load_hf_model(hf_dir, config):
    """The model of `config` with every weight from a Hugging Face folder. transformers
    reads it (and renames legacy layouts such as Mixtral's per-expert tensors); anything
    missing, unexpected or of another shape is an error, not a random initialisation. A
    folder whose config.json computes what its family refuses (Mistral's sliding window,
    Qwen's use_sliding_window, attention biases...) is refused as the converter refuses
    it: `config` would silently replace it with full attention."""
    import transformers

    from ..families.hf_config import model_config_from_hf, read_hf_config

    model_config_from_hf(read_hf_config(hf_dir), "checkpoint.load")  # UnsupportedModel with the reason
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), config=config, dtype=torch.float32, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise ValueError(f"{hf_dir} does not hold this model's weights: {wrong}")
    return model


def load_balancing_loss(m, router_logits) -> torch.Tensor:
    """For model config `m`: Megatron-Core's switch load-balancing loss, layer by layer, from the router logits
    transformers returns (its own `aux_loss` pools all layers before the product, a
    different loss); Megatron-Core's functions compute it, with the model's coefficient and
    the family's score function (Mixtral's and Qwen3-MoE's router: softmax over all
    experts, whatever the top-k renormalisation). With TP=CP=1 Megatron-Core counts the
    tokens of this micro-batch on this rank, as here."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    score_function = megatron_router(m.family)["moe_router_score_function"]  # as the family's router scores
    total = 0.0
    for logits in router_logits:
        logits = logits.float().view(-1, m.num_experts)
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, m.moe_router_topk, score_function)
        total = total + switch_load_balancing_loss_func(
            probs=scores, tokens_per_expert=routing_map.sum(dim=0), total_num_tokens=logits.shape[0],
            topk=m.moe_router_topk, num_experts=m.num_experts, moe_aux_loss_coeff=m.moe_aux_loss_coeff)
    return total


def causal_lm_loss(model, batch, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(the language-model loss to report, the objective to differentiate) of one
    micro-batch: the mean next-token cross-entropy over the tokens `loss_mask` keeps, as
    the Megatron engine computes it (Megatron-Core's indexed dataset masks padding, whose
    labels it rewrites), plus Megatron-Core's load-balancing loss for a mixture of experts."""
    moe = m.num_experts > 0
    # No KV cache: training never reads one (and transformers warns when recomputed layers are asked for one)
    out = model(input_ids=batch["tokens"], use_cache=False, **({"output_router_logits": True} if moe else {}))
    logits = out.logits
    per_token = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch["labels"].view(-1), reduction="none")
    mask = batch["loss_mask"].view(-1).float()
    loss = torch.sum(per_token * mask) / mask.sum()
    return loss, (loss + load_balancing_loss(m, out.router_logits) if moe else loss)
