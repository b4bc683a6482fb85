"""DeepSpeed's universal checkpoint, which lets a resume change the data-parallel size.

Three things of DeepSpeed 0.19.8 that gridwright stands on: the converter
(`deepspeed.checkpoint.ds_to_universal`, a non-public module run as a script) refuses a
checkpoint without its `universal_checkpoint_info` entry, which a save must therefore
write; the converter's command line; and two defects of the ZeRO-3 universal load that
`restore_zero3_param_groups` repairs.
"""
from __future__ import annotations

from pathlib import Path

CONVERTER = "deepspeed.checkpoint.ds_to_universal"

CITED = [
    # the entry the converter asserts (client_state_entry writes it)
    ("deepspeed/checkpoint/ds_to_universal.py",
     "assert universal_checkpoint_info is not None, f'Required {UNIVERSAL_CHECKPOINT_INFO} state is missing in "
     "checkpoint. Verify that client creates this state.'"),
    ("deepspeed/checkpoint/constants.py", "UNIVERSAL_CHECKPOINT_INFO = 'universal_checkpoint_info'"),
    # the converter's command line (converter_args)
    ("deepspeed/checkpoint/ds_to_universal.py",
     "parser.add_argument('--input_folder', type=str, required=True, help='Input DeepSpeed Checkpoint folder')"),
    ("deepspeed/checkpoint/ds_to_universal.py",
     "parser.add_argument('--output_folder', type=str, required=True, help='Output DeepSpeed checkpoint folder')"),
    ("deepspeed/checkpoint/ds_to_universal.py", "parser.add_argument('--num_extract_workers',"),
    ("deepspeed/checkpoint/ds_to_universal.py", "        '--num_merge_workers',"),
    # where the converter leaves the optimizer's param groups (restore_zero3_param_groups reads them)
    ("deepspeed/checkpoint/ds_to_universal.py", 'zero_output_folder = os.path.join(args.output_folder, "zero")'),
    ("deepspeed/checkpoint/ds_to_universal.py", "output_file_path = os.path.join(zero_output_folder, \"optimizer_state.pt\")"),
    ("deepspeed/checkpoint/ds_to_universal.py", "output_sd[PARAM_GROUPS] = output_sd[OPTIMIZER_STATE_DICT][PARAM_GROUPS]"),
    ("deepspeed/checkpoint/constants.py", 'OPTIMIZER_STATE_DICT = "optimizer_state_dict"'),
    # the two defects of load_hp_checkpoint_state_from_checkpoint_dir_stage3 it repairs
    ("deepspeed/runtime/zero/stage3.py",
     'for key, value in optim_sd[OPTIMIZER_STATE_DICT]["param_groups"][0].items():'),
    ("deepspeed/runtime/zero/stage3.py", "self.optimizer.state[fp32_param]['step'] = state_step"),
]


def client_state_entry() -> dict:
    """The entry a save's `client_state` carries so that the converter accepts the
    checkpoint (for a model without tensor parallelism the version is all it reads)."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def converter_args(source: Path, target: Path) -> list[str]:
    """The converter's arguments turning `source` (one saved tag) into `target`: one
    extract and one merge worker, so it starts no process pool."""
    return ["--input_folder", str(source), "--output_folder", str(target),
            "--num_extract_workers", "1", "--num_merge_workers", "1"]


def optimizer_state_file(universal: Path) -> Path:
    """Where the converter leaves the optimizer's state, parameter groups included."""
    return universal / "zero" / "optimizer_state.pt"


def restore_zero3_param_groups(optimizer, saved: dict) -> None:
    """Repair DeepSpeed 0.19.8's ZeRO-3 universal load of `optimizer` (the engine's) from
    `saved`, the converted checkpoint's `optimizer_state_file`, read by the caller through
    gridwright's checkpoint reader (this door sits below it). Its `load_hp_checkpoint_state_from_checkpoint_dir_stage3`
    copies the first saved parameter group's settings into every group (so the no-decay
    group decays: `wd_mult` 0 becomes 1), and gives every group one shared `step` tensor,
    which Adam then advances once per group (both measured). Put each group's settings
    back and give each its own step."""
    import torch

    groups = saved["optimizer_state_dict"]["param_groups"]
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for state in optimizer.optimizer.state.values():  # the wrapped torch optimizer's per-tensor state
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
