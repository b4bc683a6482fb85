"""What gridwright reads off (or sets on) a DeepSpeed engine beyond its documented config.

Two attributes `DeepSpeedEngine.__init__` and `step` set, which the engines read for the
run's record: the process group gradients are reduced over (the layout a run reports is
the one DeepSpeed uses, not the one gridwright asked for), and the count of steps skipped
on an fp16 overflow (the learning-rate schedule must not advance then). And ZeRO-3's
leaf-module flag, set on the decoder layers (`zero.stage3_leaf_layers`).
"""
from __future__ import annotations

CITED = [
    ("deepspeed/runtime/engine.py", "self.seq_data_parallel_group = groups._get_sequence_data_parallel_group()"),
    # the group ZeRO partitions and reduces over
    ("deepspeed/runtime/engine.py", "dp_process_group=self.seq_data_parallel_group,"),
    ("deepspeed/runtime/engine.py", "        if overflow:\n            self.skipped_steps += 1\n"),
    # ZeRO-3 leaf modules: a flag its parameter coordinator reads on each module
    ("deepspeed/utils/z3_leaf_module.py", "def set_z3_leaf_modules(model: torch.nn.Module,"),
]


def data_parallel_group(engine):
    """The process group the engine reduces and partitions gradients over (with
    DeepSpeed's own sequence parallelism off, as here: the data-parallel group)."""
    return engine.seq_data_parallel_group


def skipped_steps(engine) -> int:
    """How many optimizer steps the engine has skipped on an fp16 overflow so far."""
    return engine.skipped_steps


def gather_whole_layers(model, layer_class) -> None:
    """Make ZeRO-3 fetch and release every `layer_class` module's parameters at once (its
    leaf modules) rather than hooking each submodule: one host round per layer."""
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [layer_class])
