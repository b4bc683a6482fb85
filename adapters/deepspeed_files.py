"""Reading a DeepSpeed engine checkpoint: its manifest and its consolidated weights.

The DeepSpeed engine trains a Hugging Face model, so its weights already carry Hugging
Face names; what a conversion has to do is gather them. Under ZeRO 1-3 the fp32 weights
live in each data-parallel rank's optimizer partition, and DeepSpeed's own
`zero_to_fp32` reassembles them (used rather than re-deriving its partition layout).
Without ZeRO the module's state in `mp_rank_00_model_states.pt` is the whole model. Both
are DeepSpeed's file layout, read in `deepspeed_internals.checkpoint_files`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoints.checkpoint_dir import DEEPSPEED_MANIFEST, CheckpointError, checkpoint_to_load, engine_of, read_manifest
from ..checkpoints.checkpoint_trust import load_torch_file, refuse_pickled_code


class NotADeepSpeedCheckpoint(ValueError):
    pass


def find_deepspeed_checkpoint(path: str | Path) -> Path:
    """The iteration directory to convert: `path` itself (one `iter_N`), or the checkpoint
    root's latest, refused when damaged or written by the Megatron engine."""
    path = Path(path)
    if (path / DEEPSPEED_MANIFEST).is_file():
        return path
    try:
        it = checkpoint_to_load(path) if path.is_dir() else None
    except CheckpointError as e:
        raise NotADeepSpeedCheckpoint(str(e)) from e
    if it is None:
        raise NotADeepSpeedCheckpoint(f"{path} is not a DeepSpeed checkpoint of gridwright (no 'latest' and no "
                                      f"{DEEPSPEED_MANIFEST}).")
    if engine_of(it) != "deepspeed":
        raise NotADeepSpeedCheckpoint(f"{it} was written by the Megatron engine: use megatron-to-hf.")
    return it


def consolidated_weights(iteration: Path) -> dict[str, torch.Tensor]:
    """Every weight of the model saved in `iteration`, whole, by Hugging Face name (fp32
    master weights where the optimizer keeps them)."""
    from ..deepspeed_internals.checkpoint_files import whole_model  # refuses an untested DeepSpeed

    refuse_pickled_code(iteration)  # before DeepSpeed's own readers touch a file
    return whole_model(iteration, read_manifest(iteration)["files"], load_torch_file)
