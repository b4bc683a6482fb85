"""Fixes for Megatron-Core 0.16.1 bugs that appear without Transformer Engine or Apex.

They bite on GPUs too (the GPU machines here have neither), so every Megatron run applies
them, unlike the CPU-only workarounds in `megatron_cpu_compat`. Each names the upstream
line in CITED; `tests/test_megatron_internals.py` checks that each line is still there.
"""
from __future__ import annotations

import torch

_applied = False

CITED = [
    ("transformer/moe/moe_utils.py", "if te_general_gemm is not None"),  # _bind_te_general_gemm
    ("optimizer/distrib_optimizer.py", 'dst_tensors = {"param": main_param, **optim_state}'),  # _skip_step_...
    ("optimizer/distrib_optimizer.py", '                s["step"] = step\n'),  # _untie_adam_steps_after_loading
    # reduce_expert_grads_over_expert_dp
    ("tensor_parallel/layers.py", 'setattr(self.weight, "allreduce", not (self.is_expert and self.expert_parallel))'),
]


def apply_megatron_fixes() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    _bind_te_general_gemm()
    _skip_step_when_loading_reshardable_optimizer_state()
    _untie_adam_steps_after_loading()


def reduce_expert_grads_over_expert_dp(chunks, tcfg) -> int:
    """tensor_parallel/layers.py:886 and :1209 (the expert linears of the local spec), and
    likewise extensions/transformer_engine.py:644/:1551 and transformer/moe/experts.py:203,
    mark an expert parameter `allreduce=False` only when EP > 1. With EP = 1 and an
    expert-TP degree different from TP, expert weights are then put in DDP's dense buffer
    (distributed/distributed_data_parallel.py:122) and reduced over the dense DP group
    instead of the expert DP group: at TP=2+SP/ETP=1 the two TP ranks' halves of the
    sequence are never summed (each rank keeps ~half the gradient), at TP=1/ETP=2 the two
    ETP ranks' different shards are summed together. The optimizer splits its dense and
    expert groups on the same attribute (optimizer/__init__.py:165). Fixed upstream by
    NVIDIA/Megatron-LM#5916 (commit cd4afffa64, first in core_v0.19.0): experts use the
    expert groups when EP > 1 or expert-TP != TP. Only that gradient reduction is ported
    here; the PR's other part (gradient-norm counting of Transformer Engine experts at
    EP > 1, TP > 1, ETP = 1) is not: no run here has TE. Must run before the DDP wrapper
    and the optimizer are built. Returns how many parameters it re-marked."""
    if tcfg.num_moe_experts is None:
        return 0
    etp = tcfg.expert_tensor_parallel_size or tcfg.tensor_model_parallel_size
    if tcfg.expert_model_parallel_size == 1 and etp == tcfg.tensor_model_parallel_size:
        return 0  # the expert grid is the dense grid: the dense groups are right
    from megatron.core.transformer.moe.moe_layer import MoELayer

    changed = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for param in module.experts.parameters():  # routed experts, not shared ones
                    if getattr(param, "allreduce", True):
                        param.allreduce = False
                        changed += 1
    return changed


def _bind_te_general_gemm() -> None:
    """transformer/moe/moe_utils.py:1192 reads `te_general_gemm`, a name bound only when
    TE imports: every MoE router forward raises NameError without TE."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _skip_step_when_loading_reshardable_optimizer_state() -> None:
    """optimizer/distrib_optimizer.py:938 copies every per-parameter optimizer state from
    the checkpoint, but torch's Adam (the fallback without Apex/TE) keeps a per-parameter
    'step' that the fully reshardable format does not store (load_state_dict has already
    set it from the param groups): KeyError 'step'. Leave 'step' out of that copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _untie_adam_steps_after_loading() -> None:
    """optimizer/distrib_optimizer.py:825 gives every parameter's Adam state the *same*
    'step' tensor when loading without Apex/TE. torch's Adam increments each parameter's
    step in place, so after a resume the shared counter runs ahead by the number of
    parameters per update and the bias correction is wrong: the resumed run drifts
    from the uninterrupted one. Give each parameter its own copy after loading."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state and isinstance(state["step"], torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    DistributedOptimizer.load_state_dict = load_state_dict
