"""DeepSpeed's ZeRO settings (`conf/zero`): the values a run uses, and what is wrong with them.

A key left null in conf takes DeepSpeed's documented default (DeepSpeedZeroConfig,
deepspeed/runtime/zero/config.py, and https://www.deepspeed.ai/docs/config-json/, whose
ZeRO tutorial, https://www.deepspeed.ai/tutorials/zero/, uses the same 5e8 buckets):

- `reduce_bucket_size` and `allgather_bucket_size` 5e8 elements, `stage3_prefetch_bucket_size`
  5e7, `stage3_param_persistence_threshold` 1e5, `stage3_max_live_parameters` 1e9;
- `overlap_comm` true on CUDA at every stage (DeepSpeed's own default: stage 3 only; false on
  CPU, where there are no streams to overlap on) and
  `contiguous_gradients` true, as in every example config of both documentations;
- ZeRO++ off: `zero_hpz_partition_size` 1, `zero_quantized_weights` and
  `zero_quantized_gradients` false;
- gridwright's `stage3_leaf_layers` true: ZeRO-3 fetches a whole decoder layer at once
  (DeepSpeed's leaf modules) instead of each linear on its own.

Sized by the model instead, as the Hugging Face integration's "auto" does (reduce bucket
hidden_size^2, prefetch 0.9 x hidden_size^2, persistence 10 x hidden_size;
https://huggingface.co/docs/transformers/deepspeed), the bench model (hidden 2048) ran
slower in the same call on 2 x H100: ZeRO-3 21,083 tokens/s/GPU against 27,052 with
DeepSpeed's defaults, ZeRO-1 55,740 against 57,050. Leaf layers took ZeRO-3 to 44,745 on
2 x H200 (evaluations/results/zero_speed_2xh100_20261127-2327_engines.md, _settings.md and
zero_speed_2xh200_20261127-2336.md, in git history at commit bf0dede13eb6).

Torch-free and DeepSpeed-free: validation imports it.
"""
from __future__ import annotations

# DeepSpeed 0.19.8's DeepSpeedZeroConfig defaults (deepspeed/runtime/zero/config.py).
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000  # reduce_bucket_size: pp_int(5e8)
DEEPSPEED_ALLGATHER_BUCKET_SIZE = 500_000_000  # allgather_bucket_size: pp_int(5e8)
DEEPSPEED_PREFETCH_BUCKET_SIZE = 50_000_000  # stage3_prefetch_bucket_size: pp_int(5e7)
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters: pp_int(1e9)
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold: pp_int(1e5)

# The keys of conf/zero that only DeepSpeed reads, in the order of the schema.
ZERO12_KEYS = ("allgather_bucket_size",)
STAGE3_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold",
               "stage3_leaf_layers")
# gridwright's own keys among them, which DeepSpeed's JSON does not carry (the engine applies them).
GRIDWRIGHT_KEYS = ("stage3_leaf_layers",)
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
DEEPSPEED_KEYS = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", *ZERO12_KEYS, *STAGE3_KEYS,
                  *ZEROPP_KEYS)
ZEROPP_OFF = {"zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_gradients": False}


def _set(z, key: str):
    """The value conf gives `key` (None: derive it)."""
    return getattr(z, key, None)


def _on(z, key: str) -> bool:
    """A ZeRO++ key set to something other than its off value."""
    v = _set(z, key)
    return v is not None and v != ZEROPP_OFF[key]


def resolved_zero_settings(zero, cluster) -> dict:
    """The ZeRO settings DeepSpeed will run with, by key (its zero_optimization names): only
    those the stage reads. ZeRO-0 runs no ZeRO optimizer and reads none; `allgather_bucket_size`
    is ZeRO-1/2's, the stage3_* and ZeRO++ keys ZeRO-3's. `cluster.device` decides overlap_comm."""
    z = zero
    stage = int(z.stage)
    if stage == 0:
        return {}

    def pick(key, default):
        v = _set(z, key)
        return default if v is None else v

    out = {
        "overlap_comm": bool(pick("overlap_comm", cluster.device == "cuda")),
        "contiguous_gradients": bool(pick("contiguous_gradients", True)),
        "reduce_bucket_size": int(pick("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET_SIZE)),
    }
    if stage < 3:
        out["allgather_bucket_size"] = int(pick("allgather_bucket_size", DEEPSPEED_ALLGATHER_BUCKET_SIZE))
        return out
    out["stage3_prefetch_bucket_size"] = int(pick("stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_BUCKET_SIZE))
    out["stage3_max_live_parameters"] = int(pick("stage3_max_live_parameters", DEEPSPEED_MAX_LIVE_PARAMETERS))
    out["stage3_param_persistence_threshold"] = int(pick("stage3_param_persistence_threshold",
                                                         DEEPSPEED_PERSISTENCE_THRESHOLD))
    out["stage3_leaf_layers"] = bool(pick("stage3_leaf_layers", True))
    out["zero_hpz_partition_size"] = int(pick("zero_hpz_partition_size", 1))
    out["zero_quantized_weights"] = bool(pick("zero_quantized_weights", False))
    out["zero_quantized_gradients"] = bool(pick("zero_quantized_gradients", False))
    return out


def explicit_deepspeed_only_keys(zero) -> list[str]:
    """The DeepSpeed-only ZeRO settings the user set (key names under `zero.`, schema order):
    non-null, except a ZeRO++ key at its off value (zero_hpz_partition_size=1,
    zero_quantized_*=false), which asks for nothing. engine=megatron reads none of them (its
    own knobs: engine.overlap_grad_reduce, engine.bucket_size)."""
    return [k for k in DEEPSPEED_KEYS if _set(zero, k) is not None and (k not in ZEROPP_OFF or _on(zero, k))]


def zero_settings_problems(zero, cluster, layout) -> list[str]:
    """One line per problem with the ZeRO settings of an engine=deepspeed run (`layout` gives
    the data-parallel size): sizes DeepSpeed refuses or cannot use, keys the stage ignores,
    hpZ groups that do not tile the data-parallel ranks, and ZeRO++ quantization where
    DeepSpeed has no kernels for it or does not use it (`cluster`: its device, nodes and
    GPUs per node)."""
    z, out = zero, []
    stage = int(z.stage)

    # Sizes. DeepSpeedZeroConfig: reduce_bucket_size gt=0, the others ge=0; an
    # allgather_bucket_size of 0 divides by zero in deepspeed.runtime.utils.all_gather_dp_groups.
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        v = _set(z, key)
        if v is not None and v <= 0:
            out.append(f"zero.{key}={v} must be a positive number of elements. Fix: leave it null "
                       f"(derived: {_derived_text(key)}) or set a positive size.")
    for key in STAGE3_KEYS:
        v = _set(z, key)
        if v is not None and v < 0:
            out.append(f"zero.{key}={v} must be 0 or more. Fix: leave it null (derived: {_derived_text(key)}).")
    hpz = _set(z, "zero_hpz_partition_size")
    if hpz is not None and hpz < 1:
        out.append(f"zero.zero_hpz_partition_size={hpz} must be 1 or more (1: no hpZ; the GPUs of a node, "
                   "e.g. 8, for ZeRO++'s hierarchical partitioning).")

    # Keys this stage does not read.
    if stage == 0:
        keys = [f"zero.{k}={_fmt(_set(z, k))}" for k in explicit_deepspeed_only_keys(z)]
        if keys:
            out.append(f"{', '.join(keys)} with zero.stage=0: ZeRO-0 runs no ZeRO optimizer and DeepSpeed ignores "
                       "these. Fix: remove them, or zero.stage=1, 2 or 3.")
        return out
    if stage < 3:
        stage3 = [f"zero.{k}={_fmt(_set(z, k))}" for k in STAGE3_KEYS if _set(z, k) is not None]
        if stage3:
            out.append(f"{', '.join(stage3)} with zero.stage={stage}: these are ZeRO-3's (parameter partitioning) "
                       "and DeepSpeed ignores them at stages 1-2. Fix: remove them, or zero.stage=3.")
        zpp = [f"zero.{k}={_fmt(_set(z, k))}" for k in ZEROPP_KEYS if _on(z, k)]
        if zpp:
            out.append(f"{', '.join(zpp)} with zero.stage={stage}: ZeRO++ (hpZ, qwZ, qgZ) is built on ZeRO-3's "
                       "parameter partitioning; DeepSpeed's stage 1-2 optimizer never reads these keys. "
                       "Fix: zero.stage=3, or remove them.")
        ag = _set(z, "allgather_bucket_size")
        if ag is not None and ag > 0 and ag % 2:
            out.append(f"zero.allgather_bucket_size={ag} must be even: DeepSpeed's ZeRO-1/2 optimizer asserts "
                       "'allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2' "
                       "(deepspeed/runtime/zero/stage_1_and_2.py).")
        if z.offload_optimizer and _set(z, "contiguous_gradients") is False:
            out.append("zero.contiguous_gradients=false with zero.offload_optimizer=true: DeepSpeed's ZeRO-1/2 "
                       "optimizer turns contiguous gradients on for CPU offload regardless (stage_1_and_2.py: "
                       "'contiguous_gradients or self.cpu_offload'). Fix: remove zero.contiguous_gradients.")
        return out

    # ZeRO-3.
    if _set(z, "allgather_bucket_size") is not None:
        out.append(f"zero.allgather_bucket_size={_fmt(_set(z, 'allgather_bucket_size'))} with zero.stage=3: "
                   "ZeRO-3 does not use it (it gathers parameters in stage3_prefetch_bucket_size buckets). "
                   "Fix: remove it, or set zero.stage3_prefetch_bucket_size.")
    if hpz is not None and hpz > 1 and layout.dp % hpz:
        out.append(f"zero.zero_hpz_partition_size={hpz} does not divide the data-parallel size {layout.dp}: "
                   "hpZ partitions a secondary copy of the parameters within groups of that many consecutive "
                   "ranks, which must tile the data-parallel ranks (DeepSpeed's _create_zero_param_parallel_group "
                   f"asserts it). Fix: a divisor of {layout.dp}, usually cluster.gpus_per_node="
                   f"{cluster.gpus_per_node}.")
    quantized = [f"zero.{k}=true" for k in ("zero_quantized_weights", "zero_quantized_gradients") if _on(z, k)]
    if quantized and cluster.device != "cuda":
        out.append(f"{', '.join(quantized)} on cluster.device={cluster.device}: ZeRO++'s quantization runs "
                   "DeepSpeed's CUDA quantizer kernels (QuantizerBuilder, csrc/quantization/*.cu); its CPU "
                   "accelerator has none and fails with 'This op had not been implemented on CPU backend.' "
                   "Fix: turn them off on CPU.")
    elif _on(z, "zero_quantized_gradients") and cluster.nodes < 2:
        out.append(f"zero.zero_quantized_gradients=true on cluster.nodes={cluster.nodes}: qgZ quantizes "
                   "only the gradient all-to-all between nodes; on one node DeepSpeed falls back to its plain "
                   "reduce-scatter (stage3.py: 'num_nodes > 1'), so it would do nothing. Fix: remove it.")
    return out


def _derived_text(key: str) -> str:
    return {
        "reduce_bucket_size": "5e8",
        "allgather_bucket_size": "5e8",
        "stage3_prefetch_bucket_size": "5e7",
        "stage3_max_live_parameters": "1e9",
        "stage3_param_persistence_threshold": "1e5",
    }[key]


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
