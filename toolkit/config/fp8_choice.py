"""Whose layers and whose FP8 a run gets: Transformer Engine's or torch-native (torchao's
FP8). One rule for validation, the speed notes, the workers and the model builder."""
from __future__ import annotations

TORCHAO_FP8_RECIPES = ("tensorwise", "rowwise")  # gridwright.megatron_internals.parallel_linear


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


def planned_layers(engine, precision, on_cuda: bool, te_installed: bool) -> str:
    """The plan's words for whose layers and FP8 a Megatron-Core layer spec run gets. A plan
    does not import Transformer Engine (seconds): it takes TE as importable where it is
    installed, and every worker checks its own node before it builds anything."""
    asked = engine.layer_spec == "transformer_engine"
    # asked for by name, TE is what the workers build or refuse (a cluster's nodes may have
    # it where the host that plans does not)
    te = on_cuda and (asked or transformer_engine_layers(engine, precision, te_installed))
    if te:
        why = "engine.layer_spec=auto, Transformer Engine installed here" if not asked else \
            "engine.layer_spec=transformer_engine" + ("" if te_installed else
                                                      "; not installed on this host: each worker checks its node")
    elif engine.layer_spec == "torch_native":
        why = "engine.layer_spec=torch_native"
    elif not on_cuda:
        why = "Transformer Engine runs only on CUDA"
    elif not te_installed:
        why = "engine.layer_spec=auto, Transformer Engine not installed here"
    else:
        why = f"{', '.join(torch_native_asked(engine, precision))} asks for it"
    words = f"{'transformer_engine' if te else 'torch_native'} ({why})"
    backend = fp8_backend(precision, te)
    if backend == "torchao" and precision.fp8_recipe not in TORCHAO_FP8_RECIPES:
        words += f"; FP8 {precision.fp8_recipe} needs Transformer Engine's layers (refused where they are not built)"
    elif backend:
        words += f"; FP8 {precision.fp8_recipe} by {backend}"
        if precision.fp8_output_layer:
            words += ", output layer by torchao (tensorwise)" if backend == "transformer_engine" else ", output layer too"
    return words
