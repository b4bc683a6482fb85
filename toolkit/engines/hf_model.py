"""The Hugging Face model the DeepSpeed engine trains: its transformers config, initial
weights (Megatron-Core's init rules, or a Hugging Face folder) and Megatron-Core's
load-balancing loss for mixtures of experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def hf_config(model):
    """The transformers config of the same shape as gridwright's ModelConfig (the same one
    checkpoint export writes)."""
    from omegaconf import OmegaConf

    from ..families.hf_config import transformers_config

    return transformers_config(OmegaConf.to_container(model, resolve=True))


# Hugging Face names of the layers Megatron-Core initialises with its output-layer method
# (scaled by 1/sqrt(2 x layers)): the projections that write into the residual stream.
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "down_proj", "w2.weight")


def initialise_as_megatron(model, cfg, layout) -> None:
    """Re-draw the weights with Megatron-Core's own initialisation rules (from the
    TransformerConfig the Megatron engine builds), so a default run of either engine starts
    from the same distribution: transformers draws N(0, 0.02) for every matrix, Megatron
    scales the residual-output projections down, and the curves differ for it."""
    from megatron.core.transformer import TransformerConfig

    from .megatron_model import transformer_config_kwargs

    config = TransformerConfig(**transformer_config_kwargs(cfg, layout))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                torch.nn.init.ones_(param) if "norm" in name else torch.nn.init.zeros_(param)
            elif "embed_tokens" in name:
                config.embedding_init_method(param)
            elif name.endswith(_RESIDUAL_OUTPUTS):
                config.output_layer_init_method(param)
            else:
                config.init_method(param)


def load_hf_model(hf_dir, config):
    """The model of `config` with every weight from a Hugging Face folder. transformers
    reads it (and renames legacy layouts such as Mixtral's per-expert tensors); anything
    missing, unexpected or of another shape is an error, not a random initialisation."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), config=config, dtype=torch.float32, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise ValueError(f"{hf_dir} does not hold this model's weights: {wrong}")
    return model


def load_balancing_loss(m, router_logits) -> torch.Tensor:
    """For model config `m`: Megatron-Core's switch load-balancing loss, layer by layer, from the router logits
    transformers returns (its own `aux_loss` pools all layers before the product, a
    different loss); Megatron-Core's functions compute it, with the model's coefficient."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    total = 0.0
    for logits in router_logits:
        logits = logits.float().view(-1, m.num_experts)
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, m.moe_router_topk, "softmax")
        total = total + switch_load_balancing_loss_func(
            probs=scores, tokens_per_expert=routing_map.sum(dim=0), total_num_tokens=logits.shape[0],
            topk=m.moe_router_topk, num_experts=m.num_experts, moe_aux_loss_coeff=m.moe_aux_loss_coeff)
    return total


def causal_lm_loss(model, batch, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(the language-model loss to report, the objective to differentiate) of one
    micro-batch: the mean next-token cross-entropy over the batch, as the Megatron engine
    reports it, plus Megatron-Core's load-balancing loss for a mixture of experts."""
    moe = m.num_experts > 0
    out = model(input_ids=batch["tokens"], **({"output_router_logits": True} if moe else {}))
    logits = out.logits
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch["labels"].view(-1))
    return loss, (loss + load_balancing_loss(m, out.router_logits) if moe else loss)
