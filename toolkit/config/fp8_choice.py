"""Whose layers and whose FP8 a run gets: Transformer Engine's or torch-native (torchao's
FP8). One rule for validation, the speed notes, the workers and the model builder."""
from __future__ import annotations


def torch_native_asked(engine, precision) -> list[str]:
    """The keys set that only the torch-native spec runs (gridwright's compiled layers,
    async TP and torchao's float8 linears). The float8 output layer is not among them: it
    runs under either spec (choose_torch_native_paths)."""
    keys = [f"engine.{k}=true" for k in ("compile_layers", "tp_comm_overlap") if getattr(engine, k)]
    if precision.fp8_recipe is not None and precision.fp8_backend == "torchao":
        keys.append("precision.fp8_backend=torchao")
    if precision.fp8_recipe == "rowwise":
        keys.append("precision.fp8_recipe=rowwise")
    return keys


def transformer_engine_layers(engine, precision, te_imports: bool) -> bool:
    """Whether Megatron-Core's Transformer Engine layer spec is built (else the torch-native
    one). `engine.layer_spec=auto` takes TE where it imports, unless the run asks for
    something only the torch-native spec has; `transformer_engine` where TE does not import
    is refused by validation and by every worker (engine_spec_problems), never replaced."""
    if engine.layer_spec == "torch_native":
        return False
    if engine.layer_spec == "transformer_engine":
        return te_imports
    return te_imports and not torch_native_asked(engine, precision)


def fp8_backend(precision, te_available: bool):
    """Whose FP8 runs: "transformer_engine", "torchao", or None (no FP8). `te_available`:
    Transformer Engine's layers are built (transformer_engine_layers). `auto` takes TE
    there, else torchao; rowwise exists only in torchao."""
    if precision.fp8_recipe is None:
        return None
    if precision.fp8_backend == "auto":
        return "transformer_engine" if te_available and precision.fp8_recipe != "rowwise" else "torchao"
    return precision.fp8_backend
