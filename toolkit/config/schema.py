"""Typed schema of an experiment: one dataclass per Hydra config group.

Hydra merges every YAML file of `conf/` into these dataclasses, so a misspelt key or a
value of the wrong type is an error at composition time, before anything runs. A field
with a closed set of values declares it (`choice`); validation checks every declared
choice in one pass (`declared_choices`) and says which values exist. They stay `str`
fields, not Enum-typed ones: OmegaConf 2.3 has no Literal, and an Enum mismatch would be
Hydra's multi-line composition error (exit 1) instead of gridwright's one line (exit 2).
The dataclasses carry no other logic; validation lives in `gridwright.validation.validate`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterator, Optional

from omegaconf import MISSING

from ..families.registry import FAMILIES
from ..planning.model_math import DEFINITIONS as FLOPS_DEFINITIONS

# The engines a config may name; `engine_rules.registry` opens each one's rules by this name.
ENGINES = ("megatron", "deepspeed")


class Launcher(StrEnum):
    local = "local"
    torchrun = "torchrun"
    slurm = "slurm"
    plan = "plan"
    advise = "advise"  # rank every valid layout by predicted speed (gridwright.validation.layout_advice)


class GpuRequest(StrEnum):
    auto = "auto"
    gpus_per_node = "gpus_per_node"
    gres = "gres"
    none = "none"


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class Dtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Fp8Recipe(StrEnum):
    delayed = "delayed"
    tensorwise = "tensorwise"
    blockwise = "blockwise"
    mxfp8 = "mxfp8"
    rowwise = "rowwise"


class Fp8Format(StrEnum):
    e4m3 = "e4m3"
    hybrid = "hybrid"


class Fp8Backend(StrEnum):
    auto = "auto"
    transformer_engine = "transformer_engine"
    torchao = "torchao"


class Recompute(StrEnum):
    none = "none"
    selective = "selective"
    full = "full"


class CpMode(StrEnum):
    STATIC = "static"  # one CP size (parallel.cp) for every sample
    DYNAMIC = "dynamic"  # a CP size per document, balanced over the DP ranks (packed data)


class CpScheduler(StrEnum):
    MEGATRON = "megatron"  # Megatron-Core's BalancedCPScheduler: groups of documents, barriers between
    GRIDWRIGHT = "gridwright"  # longest first by FLOPs over the whole batch, no barriers (cp_schedulers)


class CpCommType(StrEnum):
    """How static context parallelism exchanges its shards (Megatron-Core's cp_comm_type names)."""
    ALL_GATHER = "all_gather"  # every rank gathers all keys and values; two lower-right calls per layer
    A2A = "a2a"  # all-to-all: the whole sequence for 1/CP of the heads; one causal call per layer
    AUTO = "auto"  # a2a where it was measured faster and applies, else all_gather (planning.layout.cp_exchange)


class LengthDistribution(StrEnum):
    LOGNORMAL = "lognormal"
    FIXED = "fixed"


class AttentionBackend(StrEnum):
    auto = "auto"  # CUDA: the fastest exact backend, measured on the run's shape; CPU: torch's default
    cudnn = "cudnn"
    flash = "flash"
    efficient = "efficient"
    math = "math"


class LayerSpec(StrEnum):
    auto = "auto"  # Transformer Engine's where it imports, unless a torch-native-only key is set
    transformer_engine = "transformer_engine"
    torch_native = "torch_native"  # Megatron-Core's local spec with SDPA, torch RMSNorm, gridwright's linears


class CudaGraphs(StrEnum):
    none = "none"
    layers = "layers"  # Megatron-Core's own graphs (cuda_graph_impl="local"): each layer's forward and backward


class Dispatcher(StrEnum):
    alltoall = "alltoall"
    allgather = "allgather"


def choice(default, allowed) -> dataclasses.Field:
    """A str field whose value is one of `allowed` (a StrEnum, or a registry's names)."""
    return field(default=default, metadata={"choices": tuple(str(a) for a in allowed)})


def declared_choices(cfg, schema=None, prefix: str = "") -> Iterator[tuple[str, object, tuple[str, ...], bool]]:
    """(path, value, allowed values, whether null is allowed) of every field of the
    composed `cfg` that declares its choices, in schema order."""
    schema = schema or RunConfig
    for f in dataclasses.fields(schema):
        value = getattr(cfg, f.name)
        if "choices" in f.metadata:
            yield f"{prefix}{f.name}", value, f.metadata["choices"], "Optional" in str(f.type)
        elif dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            yield from declared_choices(value, f.default_factory, f"{prefix}{f.name}.")


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, SwiGLU, rotary, GQA), optionally MoE."""

    name: str = MISSING
    family: str = choice("llama", FAMILIES)  # a declared family (gridwright.families.registry): Hugging Face's model_type
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING  # key/value heads (GQA); equal to heads for MHA
    head_dim: Optional[int] = None  # None means hidden_size / heads (Qwen3 decouples it)
    vocab_size: int = MISSING
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on the query/key/value projections (Qwen2)
    # Llama-3.x rope scaling factor (low/high frequency factors 1 and 4, original context
    # 8192: the values Megatron-Core 0.16.1 fixes); None means no scaling.
    rope_scaling_factor: Optional[float] = None
    num_experts: int = 0  # 0 means dense
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2  # load-balancing loss weight


@dataclass
class ParallelConfig:
    """Parallel degrees. Data parallelism is derived: DP = world / (TP·PP·CP)."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved 1F1B)
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None means equal to tp
    sp: bool = False  # sequence parallel (needs tp > 1)
    # Megatron-Core's rank order; tp varies fastest. Kept configurable because
    # Megatron-Core exposes it, but validated against the NVLink domain.
    order: str = "tp-cp-ep-dp-pp"
    allow_tp_across_nvlink: bool = False
    allow_ep_across_nvlink: bool = False
    moe_token_dispatcher: str = choice("alltoall", Dispatcher)
    # dynamic: Megatron-Core's hybrid context parallelism over packed documents (data.packing):
    # each document gets the CP size its length needs, from groups of 1, 2, 4 ... DP ranks,
    # and a balanced schedule spreads the documents over the DP ranks (parallel.cp stays 1).
    cp_mode: str = choice("static", CpMode)
    # static CP: how the ranks exchange their shards of a sequence (torch_attention;
    # Transformer Engine's attention takes the same names)
    cp_comm_type: str = choice("auto", CpCommType)
    # dynamic: the most tokens of one document a rank holds at once (Megatron-Core's
    # max_seqlen_per_dp_cp_rank); a longer document is split over 2, 4 ... ranks.
    # None: train.seq_length (a document is split only where memory requires it; on a GPU
    # cluster the memory check names the largest share that fits).
    max_seqlen_per_rank: Optional[int] = None
    # dynamic: who deals the documents to the ranks (gridwright.engines.cp_schedulers).
    # gridwright's was measured faster: 1.05x Megatron-Core's on 4 x H200, the 8B shape, 16k
    # per rank (evaluations/results/bench_gpu_varlen_4xh200.md); `megatron` compares.
    cp_scheduler: str = choice("gridwright", CpScheduler)


@dataclass
class ZeroConfig:
    """Optimizer-state sharding, named after DeepSpeed's ZeRO stages.

    The keys after the offloads are DeepSpeed's own ZeRO settings (engine=deepspeed only;
    engine=megatron refuses them). None means DeepSpeed's documented default, except
    overlap_comm: on with CUDA at every stage (DeepSpeed's own: on at stage 3 only), off on
    CPU; stage3_leaf_layers, gridwright's: true. The values that
    run are gridwright.engine_rules.zero_settings.resolved_zero_settings (plan.json: zero_settings).
    """

    stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    overlap_comm: Optional[bool] = None  # None: true on CUDA, false on CPU
    contiguous_gradients: Optional[bool] = None  # None: true
    reduce_bucket_size: Optional[int] = None  # elements; None: 5e8
    allgather_bucket_size: Optional[int] = None  # elements, ZeRO-1/2 only; None: 5e8
    stage3_prefetch_bucket_size: Optional[int] = None  # elements; None: 5e7
    stage3_max_live_parameters: Optional[int] = None  # None: 1e9
    stage3_param_persistence_threshold: Optional[int] = None  # elements; None: 1e5
    # ZeRO-3 on the Hugging Face model: gather each decoder layer's parameters at once (DeepSpeed's
    # leaf modules, deepspeed.utils.set_z3_leaf_modules) instead of hooking each of its linears.
    stage3_leaf_layers: Optional[bool] = None  # None: true
    # ZeRO++ (ZeRO-3 only; None: off): hpZ (a secondary copy of the parameters partitioned
    # within groups of this many ranks, usually a node's GPUs), qwZ (int8 weight all-gather)
    # and qgZ (int4 gradient all-to-all between nodes).
    zero_hpz_partition_size: Optional[int] = None  # None: 1
    zero_quantized_weights: Optional[bool] = None  # None: false
    zero_quantized_gradients: Optional[bool] = None  # None: false


@dataclass
class PrecisionConfig:
    """Training precision. FP8 fields map to Megatron-Core's TransformerConfig."""

    name: str = "fp32"
    params_dtype: str = choice("fp32", Dtype)
    fp8_recipe: Optional[str] = choice(None, Fp8Recipe)  # None: no FP8
    fp8_format: str = choice("hybrid", Fp8Format)
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_param: bool = False
    # Whose FP8 matmuls: transformer_engine | torchao (tensorwise and rowwise, dynamic scaling,
    # inside the torch-native spec; emulated on CPU) | auto (Transformer Engine where it
    # imports, else torchao for its recipes).
    fp8_backend: str = choice("auto", Fp8Backend)
    # torchao's FP8 also for the output (logit) layer, the largest matmul of a small model.
    # null (auto): on where it was measured faster and closer to bf16's loss, on the Megatron
    # engine on CUDA (gridwright.config.fp8_choice.output_layer_in_fp8 says where); off
    # elsewhere, as in Transformer Engine and TorchTitan (the logits are the most sensitive to
    # float8 rounding; evaluations/fp8_loss_check measures the loss).
    fp8_output_layer: Optional[bool] = None


@dataclass
class GpuConfig:
    """One accelerator kind with its published dense peaks (TFLOP/s, no sparsity)."""

    name: str = "cpu"
    memory_gib: float = 0.0  # 0 means unknown; the memory check is then skipped
    peak_bf16_tflops: float = 0.0  # 0 means unknown; MFU is then not reported
    peak_fp8_tflops: float = 0.0
    fp8_recipes: list[str] = field(default_factory=list)  # FP8 recipes this kind runs


@dataclass
class ClusterConfig:
    name: str = "laptop"
    device: str = choice("cpu", Device)  # cpu (gloo) | cuda (nccl)
    nodes: int = 1
    gpus_per_node: int = 2  # processes per node on cpu
    nvlink_domain_size: int = 8  # GPUs that share one NVLink domain
    inter_node_gbps: float = 0.0  # per-GPU network bandwidth, GB/s
    # A collective-cost profile (alpha-beta fits) measured on this cluster by
    # `python -m gridwright.evaluations.bench_collectives`; None: no communication prediction.
    comm_profile: Optional[str] = None
    # Environment variables every launcher exports to this cluster's workers (NCCL tuning,
    # network interfaces). Empty by default: gridwright sets no cluster policy of its own.
    env: dict[str, str] = field(default_factory=dict)
    gpu: GpuConfig = field(default_factory=GpuConfig)


@dataclass
class EngineConfig:
    name: str = choice("megatron", ENGINES)
    # engine=deepspeed: which model DeepSpeed trains. huggingface: the transformers model of the
    # family; megatron: Megatron-Core's GPTModel, the Megatron engine's own (ZeRO-1/2, any TP);
    # auto: megatron with parallel.tp>1, else huggingface.
    deepspeed_model: str = "auto"
    # The Megatron-Core layer spec (engine=megatron): transformer_engine (TE's fused linears,
    # norms, attention and FP8 recipes; CUDA with TE installed) | torch_native (SDPA, torch
    # RMSNorm, torchao FP8; runs everywhere, compiles) | auto: TE where it imports, unless
    # compile_layers, tp_comm_overlap or torchao's FP8 is asked for (gridwright.config.fp8_choice).
    layer_spec: str = choice("auto", LayerSpec)
    # Megatron-Core DDP: overlap the gradient reduce-scatter/all-reduce with backward, and
    # (distributed optimizer only) the parameter all-gather with the next forward.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None  # elements per communication bucket; None: Megatron's default
    # torch.compile each transformer layer (the torch-native spec; fuses norms, SwiGLU,
    # rotary and casts). On 2 x H200 it gave +7 points of MFU at 1 GPU and DP=2 (README). Off
    # by default: it costs 20-80 s at start (CPU runs: inductor's C++ build), and with TP>1
    # it is refused unless tp_comm_overlap makes the layers' TP functions gridwright's own.
    compile_layers: bool = False
    # With sequence parallelism on the torch-native spec: fuse SP's all-gather and
    # reduce-scatter with the neighbouring matmuls through torch's symmetric memory
    # (gridwright.megatron_internals.parallel_linear), as TorchTitan's async TP does.
    tp_comm_overlap: bool = False
    # The kernel behind torch's scaled_dot_product_attention (gridwright.engines.attention_kernels):
    # auto times cuDNN, flash and memory-efficient on this run's own attention call at start,
    # keeps those within the dtype's error of an fp32 reference, and runs the fastest (named
    # in the summary); a name puts that kernel first. Both engines.
    attention_backend: str = choice("auto", AttentionBackend)
    # CUDA graphs, for steps whose GPU waits on the host to launch kernels (TP, CP): `layers`
    # records each transformer layer's forward and backward on the first step and replays
    # them from the second on (Megatron-Core's local graphs; no Transformer Engine needed).
    # Fixed shapes only: refused with packed documents, dynamic CP, Megatron-FSDP, full
    # recompute and on CPU (gridwright.engine_rules.megatron_rules).
    cuda_graphs: str = choice("none", CudaGraphs)
    # Megatron-Core's own fused kernels that need no Transformer Engine or Apex: SwiGLU
    # (bias_activation_fusion) and, with bf16 weights only, the vocabulary cross-entropy
    # (cross_entropy_loss_fusion, native; its backward casts the logits' gradient to bf16),
    # each a torch.compile'd function (megatron.core.jit). Fewer launches and memory
    # passes. None: on for CUDA, off on CPU (where inductor's C++ build costs each run tens
    # of seconds).
    fused_kernels: Optional[bool] = None
    # The Adam step in torch's fused form (one pass over the fp32 states and no temporaries)
    # rather than the foreach form Megatron-Core falls back to without Apex or Transformer
    # Engine (about ten passes, and a sqrt(v) as large as a parameter group). Both engines,
    # wherever the optimizer is torch's (DeepSpeed's offload runs its own CPU Adam).
    # false: the foreach form, for comparison.
    fused_adam: bool = True
    # Megatron-Core's gradient-accumulation fusion: each linear's weight-gradient GEMM adds
    # into DDP's fp32 gradient buffer directly (torch's mixed-dtype addmm standing in for
    # Apex's extension, gridwright.megatron_internals.wgrad_accumulation), instead of writing
    # a bf16 gradient that a separate kernel then adds. None: on for CUDA where Megatron-Core's
    # DDP keeps that buffer (engine=megatron, zero.stage 0-2); off on CPU, which has no
    # mixed-dtype GEMM to fuse (true runs there, for the tests). true under Megatron-FSDP or on
    # DeepSpeed is refused.
    gradient_accumulation_fusion: Optional[bool] = None
    # CUDA_DEVICE_MAX_CONNECTIONS of the workers (hardware queues per GPU). None: the
    # engine's choice (`cuda_device_max_connections` in its rules): 1 for Megatron-Core,
    # whose SP and gradient overlap rely on it to order communication before compute, 8
    # (CUDA's default) with tp_comm_overlap and for DeepSpeed's ZeRO side streams.
    cuda_device_max_connections: Optional[int] = None


@dataclass
class LauncherConfig:
    name: str = choice("local", Launcher)
    master_addr: str = "127.0.0.1"  # torchrun: node 0's address (Slurm finds its own)
    master_port: int = 29500
    # Interpreter of the emitted torchrun lines and Slurm script; None: the one planning.
    python: Optional[str] = None
    # Local launcher: restarts of the whole worker group (torchrun's elastic restart) after
    # a worker is lost; each resumes from the newest checkpoint in checkpoint.save.
    max_restarts: int = 0
    # launcher=advise: how many of the best layouts are printed, saved and logged; how many of
    # them are then run here as short measured runs of `verify_steps` steps (0: none)
    top: int = 10
    verify: int = 0
    verify_steps: int = 10
    # precision presets (conf/precision/) the advisor may choose among, e.g. [bf16,fp8_tensorwise];
    # empty: the composed precision only (FP8 changes the numerics: a user's choice to offer)
    precisions: list[str] = field(default_factory=list)
    # Slurm (each None or empty: not asked for)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_limit: str = "01:00:00"
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None  # per node, e.g. 200G
    # auto: --gpus-per-node on CUDA clusters, nothing on CPU | gpus_per_node | gres | none
    gpu_request: str = choice("auto", GpuRequest)
    exclusive: bool = True
    extra_directives: list[str] = field(default_factory=list)  # e.g. ["--reservation=r1"]
    setup: Optional[str] = None  # shell lines before srun: modules, a venv, exports
    container_image: Optional[str] = None


@dataclass
class TrackingConfig:
    enabled: bool = True
    # MLFLOW_TRACKING_URI, when set, wins (a remote server); else a local SQLite file.
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "gridwright"


@dataclass
class TrainConfig:
    steps: int = 10
    seq_length: int = 128
    micro_batch_size: int = 2
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    weight_decay: float = 0.01
    grad_clip: float = 0.0  # 0 disables clipping
    seed: int = 1234
    recompute: str = choice("none", Recompute)
    log_interval: int = 1


@dataclass
class DocLengths:
    """Document lengths of the synthetic packed stream (data.packing): a lognormal with
    this median and sigma, clipped to [min, cap] (cap None: train.seq_length)."""

    distribution: str = choice("lognormal", LengthDistribution)
    median: int = 256
    sigma: float = 1.0
    min: int = 8
    cap: Optional[int] = None


@dataclass
class DataConfig:
    """Training data: synthetic tokens, or datasets made by `python -m gridwright.data.prepare_data`."""

    kind: str = "synthetic"  # synthetic | indexed
    paths: list[str] = field(default_factory=list)  # dataset prefixes (without .bin/.idx)
    weights: Optional[list[float]] = None  # blend weights, one per path; None: by size
    split: str = "98/2/0"  # train/validation/test shares of the documents ("," works in YAML)
    eval_interval: int = 0  # validation loss every N steps (and after the last); 0: never
    eval_iters: int = 2  # global batches per validation
    # Rows of whole documents (cu_seqlens): attention stays inside a document, positions
    # restart, the loss is per token. Synthetic data then draws document lengths from
    # doc_lengths; indexed data is cut at its EOD tokens.
    packing: bool = False
    doc_lengths: DocLengths = field(default_factory=DocLengths)


@dataclass
class CheckpointConfig:
    """Checkpoints of the run's engine: Megatron-Core distributed checkpoints
    (engine=megatron) or DeepSpeed's (engine=deepspeed), under the same iter_N/ + latest."""

    save: Optional[str] = None  # directory for checkpoints; None: no checkpoints
    save_interval: int = 0  # save every N steps; 0: only after the last step
    keep_last: int = 0  # keep the newest N checkpoints in checkpoint.save, removing older ones; 0: keep all
    # resume from the newest complete checkpoint here (engine=deepspeed: or a Hugging Face
    # folder of this model's shape, the run's initial weights)
    load: Optional[str] = None
    weights_only: bool = False  # load model weights only (fine-tuning, converted checkpoints; engine=megatron)
    # A damaged latest checkpoint (a file missing or cut short) is refused before start;
    # true: resume from the newest intact one instead.
    fallback: bool = False
    # Checkpoint files are pickles, and a pickle can run code when read. They are read with
    # an allowlist (gridwright.checkpoints.checkpoint_trust) and refused when they need more; true: read
    # them with full pickle, for a checkpoint of your own that carries other objects.
    trust_pickled_code: bool = False
    # Save in the background (gridwright.engines.background_saves): training stands only while
    # the state is staged (copied to host memory on CUDA) and a forked process writes it; the
    # checkpoint is published once every rank's files are on disk. The last save and a
    # stop's save are written at once. None (auto): in the background, as measured faster
    # (docs/checkpoints.md).
    async_save: Optional[bool] = None
    # A save due while the previous background write still runs: wait for it, or skip this save.
    async_busy: str = choice("wait", ("wait", "skip"))


@dataclass
class EvaluateConfig:
    """What a run measures about itself beyond loss and throughput."""

    # FLOPs definition behind `mfu` (gridwright.planning.model_math): megatron (causal attention
    # halved, as Megatron-LM) | palm (attention in full, as PaLM and TorchTitan).
    flops_definition: str = choice("megatron", FLOPS_DEFINITIONS)
    # [first, last): steps traced with torch.profiler on every rank; None: no tracing.
    profile_steps: Optional[list[int]] = None


@dataclass
class WatchdogConfig:
    """Finding a rank that stopped (gridwright.launchers.watchdog): each node's agent
    reads its ranks' heartbeats and stops the job, with their stacks, when one is late."""

    enabled: bool = True
    # A training rank is hung after stall_factor x its recent step time without a step,
    # and never before min_stall_s.
    stall_factor: float = 10.0
    min_stall_s: float = 60.0
    # The bound while starting (build, compile, checkpoint load) or finishing.
    phase_timeout_s: float = 1800.0
    # A save's bound: 5 x the previous save's time (the same bytes, at the disk's measured
    # speed) or, for the first, the checkpoint's size at 50 MB/s; never below this floor.
    save_floor_s: float = 120.0
    # torch.distributed's timeout for every collective (NCCL and gloo, Megatron-Core's groups
    # too); None: the longest watchdog bound plus a minute, so that the watchdog always
    # speaks first and names the stuck rank, not a healthy peer waiting for it in a
    # collective (torch's own defaults: 10 minutes on NCCL, 30 on gloo).
    collective_timeout_s: Optional[float] = None


@dataclass
class RunConfig:
    """The whole experiment, as composed by Hydra from `conf/`."""

    # The experiment's name (job directories, MLflow run names). Presets set it; otherwise
    # composition derives it from the model and the groups chosen (gridwright.config.compose).
    name: Optional[str] = None
    job_root: str = "jobs"
    # Explicit job directory; it must not exist yet. None: job_root/experiment/<time>.
    job_dir: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
