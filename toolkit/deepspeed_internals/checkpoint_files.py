"""DeepSpeed's checkpoint files, as gridwright reads them outside a training engine.

The converter gathers the whole model from one saved tag: under ZeRO 1-3 the fp32
weights lie in each data-parallel rank's optimizer partition and DeepSpeed's own
`zero_to_fp32` reassembles them (rather than re-deriving its partition layout); without
ZeRO, `mp_rank_00_model_states.pt` holds the whole module. The allowlisted reader
(`checkpoint_trust`) admits the few DeepSpeed classes its pickles name, which live in
non-public modules. File names, keys and class paths are those of the tested release.
"""
from __future__ import annotations

import importlib
from pathlib import Path

MODEL_STATES = "mp_rank_00_model_states.pt"  # the module's state without ZeRO
OPTIMIZER_PARTITION_SUFFIX = "optim_states.pt"  # one per data-parallel rank under ZeRO

# The classes DeepSpeed's optimizer states pickle: its loss scalers, the ZeRO stage enum
# and a fragment address of the parameter slice mappings.
PICKLED_CLASSES = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                   "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum",
                   "deepspeed.utils.tensor_fragment.fragment_address")

CITED = [
    ("deepspeed/runtime/engine.py", '"mp_rank_" + mp_rank_str + "_model_states.pt",'),
    ("deepspeed/runtime/engine.py", "return dict(module=module_state_dict,"),
    ("deepspeed/runtime/engine.py", 'f"{file_prefix}_mp_rank_{mp_rank:02d}_optim_states.pt",'),
    ("deepspeed/utils/zero_to_fp32.py", "def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir,"),
    ("deepspeed/runtime/fp16/loss_scaler.py", "class LossScaler(LossScalerBase):"),
    ("deepspeed/runtime/fp16/loss_scaler.py", "class DynamicLossScaler(LossScalerBase):"),
    ("deepspeed/runtime/zero/config.py", "class ZeroStageEnum(int, Enum):"),
    ("deepspeed/utils/tensor_fragment.py", "class fragment_address:"),
]


def holds_zero_partitions(file_names) -> bool:
    """Whether a saved tag with these files keeps its weights in ZeRO partitions."""
    return any(name.endswith(OPTIMIZER_PARTITION_SUFFIX) for name in file_names)


def whole_model(tag_dir: Path, file_names, load_torch_file) -> dict:
    """Every weight of the model saved in `tag_dir` (whose files are `file_names`), whole,
    by the module's parameter names; fp32 master weights where the optimizer keeps them.
    The caller has checked the files for pickled code: DeepSpeed's reader reads them, and
    `load_torch_file` (checkpoint_trust's allowlisted reader) the unpartitioned one."""
    if holds_zero_partitions(file_names):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from ..basics.known_warnings import printed_lines_filtered

        with printed_lines_filtered():  # its narration of each step
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name))
    return dict(load_torch_file(tag_dir / MODEL_STATES)["module"])


def pickled_classes() -> list:
    """The classes of PICKLED_CLASSES (imports DeepSpeed: seconds)."""
    out = []
    for dotted in PICKLED_CLASSES:
        module, name = dotted.rsplit(".", 1)
        out.append(getattr(importlib.import_module(module), name))
    return out
