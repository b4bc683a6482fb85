"""What an engine is to the rest of gridwright: rules it declares before anything starts,
and a trainer the one training loop (`training_loop`) drives. Neither side imports torch
here, so validation and planning read the rules without loading an engine.

An engine is a pair of modules:

    <name>_rules    torch-free: `NAME`, `TRAINER_MODULE`, `CAPABILITIES`,
                    `problems(cfg, layout, for_launch)` (every refusal of this engine,
                    with its reason), `checkpoint_problems(cfg)`, `state_sharding(zero)`
                    (what the ZeRO stage shards, for the memory estimate),
                    `builds_megatron_layer_spec(engine, parallel)` (whether Transformer
                    Engine's presence changes what is built),
                    `cuda_device_max_connections(engine, parallel)` (the workers' hardware
                    queues), `zero_settings(zero, cluster)` (the ZeRO settings the plan
                    records, or None) and `measured_recipes(cfg, layout)` (settings measured
                    faster for this layout, which the plan's notes name).
    <name>_engine   `open_trainer(cfg, layout, job_dir)`: a context manager that sets up
                    process groups, yields a `Trainer`, and tears them down.

`gridwright.engine_rules.registry` is the one place that picks them by `engine.name`
(`rules(cfg.engine)`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, read by the planning tools instead of asking its name."""

    models_communication: bool  # comm_model predicts its collectives (gridwright's α-β model)
    grads_reduced_in_fp32: bool  # gradient buffers are fp32 whatever the params dtype
    # engine.compile_layers / tp_comm_overlap follow the Megatron engine's rules (the torch-native
    # spec); an engine without them states its own in its rules
    megatron_torch_native_paths: bool


@dataclass(frozen=True)
class Recipe:
    """Settings measured faster for a layout: `settings` are (dotted key, value) pairs,
    `measured` says what they gave, where, and the results file that says so, and
    `measured_at` the model-parallel degrees of the layout it was measured on: a plan
    names it only for a layout of those degrees (a TP=2 result says nothing of TP=8).
    The data-parallel size may differ: the recipes act inside a model-parallel group."""

    settings: tuple[tuple[str, object], ...]
    measured: str
    measured_at: tuple[tuple[str, object], ...] = ()

    def measured_for(self, layout) -> bool:
        return all(getattr(layout, degree) == value for degree, value in self.measured_at)


@dataclass(frozen=True)
class StateSharding:
    """Which model states the ZeRO stage divides over data parallelism on this engine."""

    optimizer: bool
    gradients: bool
    weights: bool


@dataclass(frozen=True)
class Resumed:
    """Where a trainer's `load` left it: the first step to train, the checkpoint read and
    what of it was taken (for the one line the loop prints), and how this run's config
    changed the saved learning-rate schedule (a line of its own; None: it did not)."""

    first_step: int
    path: Any
    what: str
    schedule_change: str | None = None


class Trainer(Protocol):
    """One rank of one engine. The loop calls these and nothing else."""

    device: Any  # torch.device the step's tensors live on
    is_logging_rank: bool  # the rank whose metrics stand for the step
    spec_name: str  # the layer implementation that ran (summary)

    def observed_coordinates(self) -> dict:
        """This rank's coordinates and group members as built (checked against the plan)."""

    def train_step(self, step: int) -> dict:
        """One global batch: loss, lr, grad_norm, update_skipped."""

    def evaluate(self, round_index: int) -> float:
        """Validation loss over `data.eval_iters` held-out global batches."""

    def load(self, job_dir) -> Resumed | None:
        """Resume from (or start from the weights of) `checkpoint.load`; None when there is
        nothing to load."""

    def save(self, step: int, root, background=None) -> Any:
        """Write a checkpoint of the state after `step` steps under `root`; its path. With
        `background` (engines.background_saves.BackgroundSaves): stage it and hand the
        write to `background`, which publishes it later."""

    def run_facts(self) -> dict:
        """What the engine built that the summary should name (e.g. CUDA graphs captured);
        asked once, after the last step."""
