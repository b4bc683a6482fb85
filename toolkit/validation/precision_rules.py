"""The rules of precision and whose layers run it: FP8 recipes per GPU kind and backend
(Transformer Engine or torchao), the float8 output layer, the layer spec, and the
torch-native speed keys.
"""
from __future__ import annotations

from ..engine_rules.registry import is_known, rules
from ..config.fp8_choice import (TORCHAO_FP8_RECIPES, fp8_backend, torch_native_asked, transformer_engine_layers,
                                 vocab_shard_takes_float8)
from ..runtime.machine_probe import probe
from .fix_advice import override_words


# The formats torchao's recipes fix (Float8LinearConfig.from_recipe_name)
TORCHAO_FP8_FORMATS = {"tensorwise": "hybrid", "rowwise": "e4m3"}


TORCHAO_FORMAT_WORDS = {"hybrid": "E4M3 forward and E5M2 for gradients", "e4m3": "E4M3 everywhere"}


# The precision preset (conf/precision/) of each FP8 recipe
FP8_PRESETS = {"delayed": "fp8_delayed", "tensorwise": "fp8_tensorwise", "rowwise": "fp8_rowwise",
               "blockwise": "fp8_blockwise", "mxfp8": "mxfp8"}


def check_precision(cfg, for_launch: bool) -> list[str]:
    p, gpu, out = cfg.precision, cfg.cluster.gpu, []
    if p.fp8_recipe is None:
        if p.fp8_param:
            out.append("precision.fp8_param=true needs an FP8 recipe (precision.fp8_recipe).")
        if p.fp8_output_layer:
            out.append("precision.fp8_output_layer=true needs an FP8 recipe: use precision=fp8_tensorwise "
                       "(or fp8_rowwise).")
        return out
    if p.params_dtype == "fp32":
        out.append("FP8 training keeps bf16 weights: set precision.params_dtype=bf16.")
    torchao_asked = _torchao_asked(p)
    if torchao_asked:
        out += _torchao_fp8_problems(p, cfg.model, cfg.engine)
    if p.fp8_output_layer:
        out += _fp8_output_layer_problems(p, cfg.model, cfg.parallel.tp)
    if cfg.cluster.device != "cuda":
        if p.fp8_backend != "torchao":
            out.append(
                f"FP8 (precision.fp8_recipe={p.fp8_recipe}) needs CUDA GPUs; cluster '{cfg.cluster.name}' "
                f"runs on cpu. Fix: {override_words(_to_recipe(p, None))} (bf16 without FP8), a GPU cluster, or "
                "precision.fp8_backend=torchao (FP8 arithmetic emulated, for tests)."
            )
    elif not torchao_asked and p.fp8_recipe not in gpu.fp8_recipes or torchao_asked and not gpu.fp8_recipes:
        supported = ", ".join(gpu.fp8_recipes) or "none"
        other = None if torchao_asked else next((r for r in gpu.fp8_recipes if r in FP8_PRESETS), None)
        out.append(
            f"GPU kind {gpu.name} does not support FP8 recipe '{p.fp8_recipe}' (it supports: {supported}). "
            + ("MXFP8 needs Blackwell (B200/GB200). " if p.fp8_recipe == "mxfp8" else "")
            + f"Fix: {override_words(_to_recipe(p, other))}"
            + (f" (a supported recipe), or {override_words(_to_recipe(p, None))}." if other else " (bf16 without FP8).")
        )
    if p.fp8_recipe == "blockwise" and p.fp8_format != "e4m3":
        out.append("precision.fp8_recipe=blockwise uses E4M3 everywhere: set precision.fp8_format=e4m3.")
    if for_launch and cfg.launcher.name == "local" and (cfg.cluster.device == "cuda" or p.fp8_backend == "torchao"):
        te = cfg.cluster.device == "cuda" and probe(transformer_engine=True).transformer_engine
        out += fp8_machine_problems(cfg, te)
    return out


def _to_recipe(precision, recipe: str | None) -> dict:
    """The overrides that make `precision` run `recipe` (None: bf16 without FP8): its preset
    where the current recipe came from one, else the key itself (an override of the key
    would outlive a change of preset)."""
    p = precision
    from_preset = p.name == FP8_PRESETS.get(p.fp8_recipe)
    if recipe is None:
        return {"precision": "bf16"} if from_preset else {"precision.fp8_recipe": None}
    return {"precision": FP8_PRESETS[recipe]} if from_preset else {"precision.fp8_recipe": recipe}


def fp8_machine_problems(cfg, te_imports: bool) -> list[str]:
    """What this machine lacks for the run's FP8: said before a local launch, and by every
    worker at start (a Slurm or torchrun job's nodes are seen only by its workers)."""
    p = cfg.precision
    builds_spec = rules(cfg.engine).builds_megatron_layer_spec(cfg.engine, cfg.parallel)
    te_layers = builds_spec and transformer_engine_layers(cfg.engine, p, cfg.model, te_imports)
    backend = fp8_backend(p, te_layers)
    if backend is None:
        return []
    if backend == "transformer_engine" and te_layers:  # TE's layers; the float8 output layer is torchao's
        return [TORCHAO_MISSING] if p.fp8_output_layer and not torchao_available() else []
    torchao_asked = _torchao_asked(p)
    te_recipe = p.fp8_backend == "transformer_engine" or p.fp8_recipe not in TORCHAO_FP8_RECIPES
    if te_recipe and te_imports and builds_spec:  # TE is here, but the run builds the torch-native spec
        return [_te_fp8_on_torch_native(cfg.engine, p)]
    if backend == "transformer_engine":
        return [fp8_without_te(p)]
    if te_layers:  # torchao asked for where engine.layer_spec=transformer_engine builds TE's layers
        return [f"precision.fp8_backend=torchao (or recipe {p.fp8_recipe}) runs inside the torch-native layer spec, "
                "but engine.layer_spec=transformer_engine builds Transformer Engine's. Fix: engine.layer_spec=auto."]
    if not torchao_asked and p.fp8_recipe not in TORCHAO_FP8_RECIPES:
        return [fp8_without_te(p)]
    if not torchao_available():
        return [TORCHAO_MISSING]
    return [] if torchao_asked else _torchao_fp8_problems(p, cfg.model, cfg.engine)  # auto fell back to torchao: its rules apply now


def _te_fp8_on_torch_native(engine, precision) -> str:
    """A Transformer Engine recipe in a run whose keys choose the torch-native spec."""
    if engine.layer_spec == "torch_native":
        why, fix = "engine.layer_spec=torch_native", "engine.layer_spec=auto"
    else:
        keys = torch_native_asked(engine, precision)
        why = f"{', '.join(keys)} {'asks' if len(keys) == 1 else 'ask'} for the torch-native spec"
        fix = _turned_off(keys)
    return (f"precision.fp8_recipe={precision.fp8_recipe} is Transformer Engine's, but this run builds the "
            f"torch-native layer spec ({why}). Fix: {fix}.")


def _torchao_asked(precision) -> bool:
    """torchao named by the config itself, not reached by `auto` falling back."""
    return precision.fp8_backend == "torchao" or precision.fp8_recipe == "rowwise"


def _torchao_fp8_problems(precision, model, engine) -> list[str]:
    p, out = precision, []
    if p.fp8_backend == "transformer_engine":
        out.append("precision.fp8_recipe=rowwise is torchao's: set precision.fp8_backend=torchao or auto.")
    elif p.fp8_recipe not in TORCHAO_FP8_RECIPES:
        out.append(f"precision.fp8_backend=torchao offers the recipes {', '.join(TORCHAO_FP8_RECIPES)}, "
                   f"not '{p.fp8_recipe}'.")
    if model.num_experts:
        out.append("FP8 through torchao covers dense layers only, not MoE experts: use Transformer Engine "
                   "or precision=bf16 for an MoE model.")
    if p.fp8_param:
        out.append("precision.fp8_param=true is Transformer Engine's (FP8 weights); torchao keeps bf16 weights.")
    wanted = TORCHAO_FP8_FORMATS.get(p.fp8_recipe)
    if wanted and p.fp8_format != wanted:
        out.append(f"torchao's {p.fp8_recipe} recipe uses {TORCHAO_FORMAT_WORDS[wanted]}: set precision.fp8_format={wanted}.")
    if engine.tp_comm_overlap:
        out.append("engine.tp_comm_overlap=true does not combine with FP8 through torchao yet "
                   "(the fused ops run bf16 matmuls): turn one off.")
    return out


def _fp8_output_layer_problems(precision, model, tp: int) -> list[str]:
    """The output layer in float8 (torchao's tensorwise matmul under either FP8 backend:
    choose_torch_native_paths says why): its vocabulary shard a multiple of 16, which float8
    GEMMs need of every dimension."""
    if not vocab_shard_takes_float8(model.vocab_size, tp):
        return [f"precision.fp8_output_layer=true: each rank's vocabulary shard ({model.vocab_size} / TP {tp}) "
                "must be a multiple of 16 for float8 GEMMs. Use precision.fp8_output_layer=false."]
    return []


def torchao_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def fp8_without_te(precision) -> str:
    """FP8 asked of Transformer Engine where it does not import; the first fix runs FP8 through torchao."""
    p = precision
    if p.fp8_recipe in TORCHAO_FP8_RECIPES:  # Transformer Engine named explicitly
        torchao = {"precision.fp8_backend": "torchao"}
    else:
        torchao = _to_recipe(p, "tensorwise")
        if "precision.fp8_recipe" in torchao and p.fp8_format != TORCHAO_FP8_FORMATS["tensorwise"]:
            torchao["precision.fp8_format"] = TORCHAO_FP8_FORMATS["tensorwise"]
        if p.fp8_backend == "transformer_engine":
            torchao["precision.fp8_backend"] = "auto"
    return (f"FP8 needs Transformer Engine for recipe '{p.fp8_recipe}' here (torchao runs only tensorwise and "
            "rowwise), and Transformer Engine cannot be imported. Megatron-Core would silently train in bf16 while "
            f"the config says FP8, so gridwright refuses. Fix: {override_words(torchao)} (FP8 through torchao), "
            f"{override_words(_to_recipe(p, None))}, or install Transformer Engine (CUDA + cuDNN).")


TORCHAO_MISSING = "precision.fp8_backend=torchao needs torchao, which is not installed here: pip install torchao."


# Measured on 2 x H200 (bench_gpu_20261127-1530.md, evaluations/results at 8871d16): both compiled TP=2+SP
# runs through Megatron-Core's tensor-parallel linear function and its SP communication
# (linear_with_grad_accumulation_and_async_allreduce, the sequence-parallel mappings) did
# not learn: mean loss of the last 10 of 14 steps 10.48, where the uncompiled run had 8.88.
# On CPU the same run matches eager, so no CPU test can show it. With tp_comm_overlap the
# layers' TP matmuls and communication are gridwright's own autograd functions, and those
# runs learned (8.880 against 8.879).
COMPILED_MEGATRON_TP = (
    "engine.compile_layers=true with parallel.tp>1 would compile Megatron-Core's tensor-parallel linear function "
    "and its SP communication, and on GPU such a run did not learn (TP=2+SP: mean loss of the last 10 of 14 steps "
    "10.48 against 8.88 uncompiled; cause not found): add engine.tp_comm_overlap=true with parallel.sp=true "
    "(gridwright's own TP functions), or set compile_layers=false.")


def check_torch_native_paths(cfg, for_launch: bool = False) -> list[str]:
    e = cfg.engine
    if e.attention_backend in ("cudnn", "efficient") and cfg.cluster.device != "cuda":
        return [f"engine.attention_backend={e.attention_backend} is a CUDA kernel and this run is on "
                f"{cfg.cluster.device}: use auto, flash or math."]
    if e.cuda_device_max_connections is not None and not 1 <= e.cuda_device_max_connections <= 32:
        return [f"engine.cuda_device_max_connections={e.cuda_device_max_connections} must be 1 to 32 (or null)."]
    if not (is_known(e) and rules(e).CAPABILITIES.megatron_torch_native_paths):
        return []  # the engine's own rules say what it compiles
    if e.tp_comm_overlap and not (cfg.parallel.sp and cfg.parallel.tp > 1):
        return ["engine.tp_comm_overlap=true overlaps sequence parallelism's communication: it needs "
                "parallel.tp>1 and parallel.sp=true."]
    if e.compile_layers and cfg.parallel.tp > 1 and not e.tp_comm_overlap:
        return [COMPILED_MEGATRON_TP]
    return check_layer_spec(cfg, for_launch)


def check_layer_spec(cfg, for_launch: bool = False) -> list[str]:
    """engine.layer_spec=transformer_engine: CUDA, the Megatron-Core model, none of the
    torch-native spec's own keys, and (before a local launch) TE importable here."""
    e = cfg.engine
    if e.layer_spec != "transformer_engine":
        return []
    if not rules(e).builds_megatron_layer_spec(e, cfg.parallel):
        return ["engine.layer_spec=transformer_engine applies to Megatron-Core's GPTModel; this run trains the "
                "Hugging Face model. Fix: engine.layer_spec=auto, or engine.deepspeed_model=megatron."]
    if cfg.cluster.device != "cuda":
        return [f"engine.layer_spec=transformer_engine needs CUDA; cluster '{cfg.cluster.name}' runs on "
                f"{cfg.cluster.device}. Fix: engine.layer_spec=auto."]
    keys = torch_native_asked(e, cfg.precision)
    if keys:
        return [f"engine.layer_spec=transformer_engine with {', '.join(keys)}: "
                f"{'that runs' if len(keys) == 1 else 'those run'} only in the torch-native spec. "
                f"Fix: engine.layer_spec=auto, or {_turned_off(keys)}."]
    if for_launch and cfg.launcher.name == "local":
        return layer_spec_machine_problems(e, cfg.parallel, probe(transformer_engine=True).transformer_engine)
    return []


def _turned_off(keys: list[str]) -> str:
    """The overrides that turn torch_native_asked's keys off, e.g. "engine.compile_layers=false"."""
    off = {"precision.fp8_backend=torchao": "auto", "precision.fp8_recipe=rowwise": "tensorwise"}
    return " ".join(f"{k.split('=')[0]}={off.get(k, 'false')}" for k in keys)


def layer_spec_machine_problems(engine, parallel, te_imports: bool) -> list[str]:
    """Transformer Engine's layers asked for (engine.layer_spec=transformer_engine) where TE
    does not import: said before a local launch, and by every worker at start."""
    if engine.layer_spec != "transformer_engine" or te_imports:
        return []
    if not rules(engine).builds_megatron_layer_spec(engine, parallel):
        return []
    return [LAYER_SPEC_WITHOUT_TE]


LAYER_SPEC_WITHOUT_TE = ("engine.layer_spec=transformer_engine: Transformer Engine cannot be imported here (it needs "
                         "CUDA, cuDNN and its wheel). Fix: engine.layer_spec=auto (the torch-native spec where TE "
                         "is absent).")
