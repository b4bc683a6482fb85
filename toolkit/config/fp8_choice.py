"""Whose layers and whose FP8 a run gets: Transformer Engine's or torch-native (torchao's
FP8). One rule for validation, the speed notes, the workers and the model builder."""
from __future__ import annotations

TORCHAO_FP8_RECIPES = ("tensorwise", "rowwise")  # gridwright.megatron_internals.parallel_linear

# Whose FP8 was measured faster, by hidden size (1 x H200; docs/performance.md): at 4096 (the
# Llama-3-8B shape) Transformer Engine's FP8 ran 1.46x bf16 against torchao's best 1.35x
# (evaluations/results/bench_gpu_te_1xh200.md); at 2048 (the bench model) TE's FP8 ran
# 0.85x TE's bf16 and torchao's tensorwise 1.08x bf16 (fp8_loss_check_4xh200.md). Between the
# two shapes nothing was measured; TE's side begins at the shape where it was measured faster.
TE_FP8_MEASURED_FASTER_FROM_HIDDEN = 4096

# The float8 output layer (torchao's tensorwise matmul) was measured faster, and closer to
# bf16's loss, with these backends and recipes, on layouts of one GPU per model replica
# (TP = PP = CP = EP = 1), 1 x H200: under torchao tensorwise the Llama-3-8B shape (16
# layers) ran 1.29x bf16 with it against 1.24x without, and over four seeds of 300 steps on
# real text its final loss was 0.90 % above bf16 against 3.31 % without (docs/performance.md
# at commit 8871d16); under Transformer Engine's delayed scaling 1.46x against 1.39x in one
# call (evaluations/results/bench_gpu_te_1xh200.md). With model parallelism it was not
# measured, so `auto` leaves it off there.
OUTPUT_LAYER_MEASURED_FASTER = (("torchao", "tensorwise"), ("transformer_engine", "delayed"))


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


def torchao_fp8_measured_faster(model, precision) -> bool:
    """FP8 left to `auto` (tensorwise, which both have) on a shape where torchao's float8
    matmuls were measured faster than Transformer Engine's FP8 (below TE's measured hidden size)."""
    return (precision.fp8_recipe == "tensorwise" and precision.fp8_backend == "auto"
            and model.hidden_size < TE_FP8_MEASURED_FASTER_FROM_HIDDEN)


def transformer_engine_layers(engine, precision, model, te_imports: bool) -> bool:
    """Whether Megatron-Core's Transformer Engine layer spec is built (else the torch-native
    one). `engine.layer_spec=auto` takes TE where it imports, unless the run asks for
    something only the torch-native spec has, or leaves its FP8 to `auto` on a shape where
    torchao's was measured faster; `transformer_engine` where TE does not import is refused
    by validation and by every worker (engine_spec_problems), never replaced."""
    if engine.layer_spec == "torch_native":
        return False
    if engine.layer_spec == "transformer_engine":
        return te_imports
    return te_imports and not torch_native_asked(engine, precision) and not torchao_fp8_measured_faster(model, precision)


def fp8_backend(precision, te_available: bool):
    """Whose FP8 runs: "transformer_engine", "torchao", or None (no FP8). `te_available`:
    Transformer Engine's layers are built (transformer_engine_layers). `auto` takes TE
    there, else torchao; rowwise exists only in torchao."""
    if precision.fp8_recipe is None:
        return None
    if precision.fp8_backend == "auto":
        return "transformer_engine" if te_available and precision.fp8_recipe != "rowwise" else "torchao"
    return precision.fp8_backend


def vocab_shard_takes_float8(vocab_size: int, tp: int) -> bool:
    """Whether each TP rank's vocabulary shard is whole and a multiple of 16, which float8
    GEMMs need of every dimension (the output layer's)."""
    return vocab_size % tp == 0 and (vocab_size // tp) % 16 == 0


def output_layer_in_fp8(precision, backend, parallel, model, on_cuda: bool) -> bool:
    """Whether the output layer runs in float8 (Megatron-Core's layer spec): as asked, or
    under `auto` (null) where it was measured faster (OUTPUT_LAYER_MEASURED_FASTER: the
    backend and recipe, one GPU per model replica, CUDA) and its vocabulary is a multiple of
    16, which float8 GEMMs need, and torchao is installed (it runs the output layer under
    either backend; asked for by name without it, validation refuses)."""
    import importlib.util

    if precision.fp8_output_layer is not None:
        return bool(precision.fp8_output_layer)
    one_gpu = all(getattr(parallel, k) == 1 for k in ("tp", "pp", "cp", "ep"))
    return (on_cuda and one_gpu and (backend, precision.fp8_recipe) in OUTPUT_LAYER_MEASURED_FASTER
            and vocab_shard_takes_float8(model.vocab_size, 1) and importlib.util.find_spec("torchao") is not None)


def planned_layers(engine, precision, model, parallel, on_cuda: bool, te_installed: bool) -> str:
    """The plan's words for whose layers and FP8 a Megatron-Core layer spec run gets. A plan
    does not import Transformer Engine (seconds): it takes TE as importable where it is
    installed, and every worker checks its own node before it builds anything."""
    asked = engine.layer_spec == "transformer_engine"
    # asked for by name, TE is what the workers build or refuse (a cluster's nodes may have
    # it where the host that plans does not)
    te = on_cuda and (asked or transformer_engine_layers(engine, precision, model, te_installed))
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
    elif torch_native_asked(engine, precision):
        why = f"{', '.join(torch_native_asked(engine, precision))} asks for it"
    else:
        why = (f"engine.layer_spec=auto: at hidden size {model.hidden_size} torchao's FP8 was measured faster than "
               f"Transformer Engine's, which was measured faster from {TE_FP8_MEASURED_FASTER_FROM_HIDDEN}")
    words = f"{'transformer_engine' if te else 'torch_native'} ({why})"
    backend = fp8_backend(precision, te)
    if backend == "torchao" and precision.fp8_recipe not in TORCHAO_FP8_RECIPES:
        words += f"; FP8 {precision.fp8_recipe} needs Transformer Engine's layers (refused where they are not built)"
    elif backend:
        words += f"; FP8 {precision.fp8_recipe} by {backend}"
        if output_layer_in_fp8(precision, backend, parallel, model, on_cuda):
            words += ", output layer by torchao (tensorwise)" if backend == "transformer_engine" else ", output layer too"
            if precision.fp8_output_layer is None:
                words += " (precision.fp8_output_layer=auto: measured faster on one GPU per model replica)"
    return words
