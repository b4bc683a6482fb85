"""Which kernel runs torch's scaled_dot_product_attention, chosen by measurement.

torch picks FlashAttention-2 by default on CUDA. At the bench shape (seq 4096, 16 heads of
128, GQA 4, bf16, H200, torch 2.11) cuDNN's backend ran forward + backward in 0.94 ms
against flash's 1.78 ms, but which one wins depends on the shape, the card and the build.
So `engine.attention_backend=auto` times each backend on the run's own attention call
(`torch_attention.causal_sdpa`, with this rank's heads, sequence and micro-batch), drops
any whose output or gradients stray from an fp32 reference by more than the dtype allows,
and puts the fastest first in torch's priority order for the whole process: a call that
kernel cannot take (a mask or shape it lacks) falls through to the next backend, as in
torch's own dispatch. Every rank measures and the slowest rank's times decide, so all
ranks run the same kernel. A named backend is used without measuring.

On CPU `auto` keeps torch's default without measuring: CPU runs are the exactness
reference, and a choice that could change with timing noise would make them differ from
one run to the next.

Context parallelism's chunks in the all-gather form attend with a lower-right causal
mask, which torch's mask object dispatches itself (flash where it can, then
memory-efficient), ignoring the priority order: for those shapes only flash and
memory-efficient are timed, and the one chosen is the only fused kernel left on. The
all-to-all form runs a plain causal call on the whole sequence, so every backend is timed
there. Packed documents on CUDA in bf16/fp16 go through torch's varlen flash kernel, not
SDPA, and Transformer Engine's spec has its own attention: the choice then touches
nothing and the summary says so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CUDA_ONLY = ("cudnn", "efficient")
# Relative L2 error of the output and of each input's gradient against the fp32 math
# kernel beyond which a backend is not exact enough (about 4 ulps of the dtype at 1.0:
# flash and cuDNN measure a few 1e-3 in bf16; a wrong mask or a NaN measures near 1).
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
# The exactness check builds the fp32 reference's full score matrix: at most this many
# positions and heads (the timing uses the whole shape).
CHECK_LENGTH = 4096
CHECK_HEADS = 4


@dataclass
class AttentionShape:
    """One rank's attention call: [batch, heads, queries, dim] against `keys` keys in
    `groups` key/value heads; `lower_right` when queries are the last `queries` of the keys
    (context parallelism's chunks). `heads_first`: SDPA gets [b, heads, s, dim]-contiguous
    tensors (CP's all-to-all form) rather than permuted views of Megatron-Core's
    [s, b, heads, dim]; a kernel may take one memory layout and not the other."""
    batch: int
    heads: int
    groups: int
    queries: int
    keys: int
    dim: int
    heads_first: bool = False

    @property
    def lower_right(self) -> bool:
        return self.queries != self.keys

    def text(self) -> str:
        q = f"{self.queries} queries x {self.keys} keys" if self.lower_right else f"sequence {self.queries}"
        return f"batch {self.batch}, {self.heads} heads / {self.groups} groups of {self.dim}, {q}"


@dataclass
class AttentionChoice:
    """What runs and why: `ms` the measured forward + backward time per call of each
    backend that ran, `error` its largest relative error, `refused` why the others did not;
    `only`: the chosen kernel is the only fused one left on (lower-right shapes)."""
    backend: str  # a BACKENDS name, "default" (torch's own order), "varlen_flash" or "transformer_engine"
    chosen_by: str  # "measurement", "setting", or why nothing was chosen
    shape: str = ""
    ms: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    only: bool = False

    def facts(self) -> dict:
        return {"backend": self.backend, "chosen_by": self.chosen_by, "shape": self.shape, "ms": self.ms,
                "error": self.error, "refused": self.refused, "only": self.only}


# In the job directory: the choice of the job's first attempt, which a restart reuses, so
# that resumed steps repeat exactly (a new measurement could pick another kernel).
CHOICE_FILE = "attention.json"


def remembered(job_dir) -> AttentionChoice | None:
    """The choice an earlier attempt of this job recorded, if any."""
    import json
    from pathlib import Path

    path = Path(job_dir) / CHOICE_FILE if job_dir else None
    if path is None or not path.is_file():
        return None
    facts = json.loads(path.read_text())
    return AttentionChoice(facts["backend"], f"{facts['chosen_by']}, kept from the job's first attempt",
                           facts["shape"], facts["ms"], facts["error"], facts["refused"], facts.get("only", False))


def remember(choice: AttentionChoice, job_dir) -> None:
    import json
    from pathlib import Path

    from ..basics.atomic_io import write_text_atomic

    if job_dir:
        write_text_atomic(Path(job_dir) / CHOICE_FILE, json.dumps(choice.facts(), indent=1))


def attention_shape(model, train, layout, cp_comm_type: str = "all_gather") -> AttentionShape:
    """This rank's fixed-length attention call: heads and key/value groups split over TP
    (groups replicated when fewer than TP), the sequence over CP. Under CP's all-gather form
    the call that decides is the rank's last chunk (1/(2·CP) of the sequence) against every
    key before it; the all-to-all form runs the whole sequence for 1/CP of the heads."""
    heads = model.num_attention_heads // layout.tp
    groups = max(1, (model.num_query_groups or model.num_attention_heads) // layout.tp)
    dim = model.head_dim or model.hidden_size // model.num_attention_heads
    s = train.seq_length
    if layout.cp > 1 and cp_comm_type == "a2a":
        return AttentionShape(train.micro_batch_size, heads // layout.cp, groups // layout.cp, s, s, dim,
                              heads_first=True)
    queries = s if layout.cp == 1 else s // (2 * layout.cp)
    return AttentionShape(train.micro_batch_size, heads, groups, queries, s, dim)


def choose(setting: str, shape: AttentionShape, dtype, device, packed: bool = False,
           transformer_engine: bool = False) -> AttentionChoice:
    """The backend for this run, agreed by every rank (see the module's docstring)."""
    device = torch.device(device)
    if transformer_engine:
        return AttentionChoice("transformer_engine", "Transformer Engine's spec runs its own attention", shape.text())
    if packed and device.type == "cuda" and _varlen_runs(dtype):
        return AttentionChoice("varlen_flash", "packed documents: torch's varlen flash kernel", shape.text())
    if setting != "auto":
        return AttentionChoice(setting, "setting", shape.text(), only=shape.lower_right)
    if device.type != "cuda":
        return AttentionChoice("default", "CPU: not measured, so that CPU runs stay repeatable", shape.text())
    candidates = ["flash", "efficient"] if shape.lower_right else ["cudnn", "flash", "efficient"]
    choice = _agree(measure(shape, dtype, device, candidates))
    choice.only = shape.lower_right
    torch.cuda.empty_cache()  # the measurement's buffers are not the run's: keep them out of its peak
    torch.cuda.reset_peak_memory_stats(device)
    return choice


def _varlen_runs(dtype) -> bool:
    """Whether packed documents take the varlen kernel (torch_attention.prefix_attention)."""
    from .torch_attention import _varlen_kernel

    return _varlen_kernel()[0] is not None and dtype in (torch.bfloat16, torch.float16)


def measure(shape: AttentionShape, dtype, device, candidates: list[str], repeats: int = 5) -> AttentionChoice:
    """Time and check each candidate on `shape`; the fastest exact one is `backend`."""
    device = torch.device(device)
    choice = AttentionChoice("default", "measurement", shape.text())
    inputs = _inputs(shape, dtype, device)
    check = _inputs(_check_shape(shape), dtype, device, seed=1)
    try:
        reference = _run(check, torch.float32, [SDPBackend.MATH])
    except RuntimeError as e:  # out of memory, say: nothing is chosen, torch's order stays
        choice.refused["reference"] = str(e).strip().splitlines()[0][:120]
        return choice
    for name in candidates:
        try:
            error = _error(_run(check, dtype, [BACKENDS[name]]), reference)
            if not error <= TOLERANCE.get(dtype, 1e-4):  # NaN fails too
                choice.refused[name] = f"relative error {error:.2e}"
                continue
            choice.error[name] = error
            choice.ms[name] = _time(lambda: _run(inputs, dtype, [BACKENDS[name]]), device, repeats)
        except RuntimeError as e:  # "No viable backend": this backend cannot take the call
            choice.refused[name] = str(e).strip().splitlines()[0][:120] or type(e).__name__
    if choice.ms:
        choice.backend = min(choice.ms, key=choice.ms.get)
    return choice


def use(choice: AttentionChoice):
    """A context holding torch's SDPA priority for the run: the chosen backend first, then
    torch's usual order (flash, efficient, math, cuDNN). For the other choices it changes
    nothing."""
    import contextlib

    if choice.backend not in BACKENDS:
        return contextlib.nullcontext()
    if choice.only:  # lower-right masks pick among the fused kernels that are on
        return sdpa_kernel(list(dict.fromkeys([BACKENDS[choice.backend], SDPBackend.MATH])), set_priority=True)
    fallback = [BACKENDS[n] for n in ("flash", "efficient", "math", "cudnn")] + [SDPBackend.OVERRIDEABLE]
    order = [BACKENDS[choice.backend]] + [b for b in fallback if b != BACKENDS[choice.backend]]
    return sdpa_kernel(order, set_priority=True)


def summary_line(facts: dict) -> str:
    """The summary's attention line, e.g. "cudnn (measurement: cudnn 0.94 ms, flash 1.78 ms ...)"."""
    times = ", ".join(f"{n} {ms:.2f} ms" for n, ms in sorted(facts["ms"].items(), key=lambda kv: kv[1]))
    refused = "; ".join(f"{n}: {why}" for n, why in facts["refused"].items())
    detail = "; ".join(x for x in (f"forward + backward per call: {times}" if times else "",
                                   f"not used: {refused}" if refused else "") if x)
    name = "torch's default SDPA order" if facts["backend"] == "default" else f"{facts['backend']} SDPA"
    return f"{name} ({facts['chosen_by']}{'; ' + detail if detail else ''})"


def _check_shape(shape: AttentionShape) -> AttentionShape:
    """The exactness check's shape: at most CHECK_LENGTH keys and CHECK_HEADS heads, the
    same kind of call (lower-right or not, grouped or not)."""
    keys = min(shape.keys, CHECK_LENGTH)
    queries = min(shape.queries, keys // 2) if shape.lower_right else keys
    heads = min(shape.heads, CHECK_HEADS)
    groups = max(1, heads // (shape.heads // shape.groups))
    return AttentionShape(1, heads, groups, queries, keys, shape.dim, shape.heads_first)


def _inputs(shape: AttentionShape, dtype, device, seed: int = 0) -> tuple:
    """q, k, v in the layout the runtime hands SDPA (see AttentionShape.heads_first), the
    output gradient, and the lower-right alignment."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda *size: torch.randn(*size, generator=g).to(device, dtype)  # noqa: E731

    def tensor(s, heads):  # as [b, heads, s, dim], contiguous or a permuted [s, b, heads, dim]
        if shape.heads_first:
            return make(shape.batch, heads, s, shape.dim)
        return make(s, shape.batch, heads, shape.dim).permute(1, 2, 0, 3)

    q, k, v = tensor(shape.queries, shape.heads), tensor(shape.keys, shape.groups), tensor(shape.keys, shape.groups)
    grad = make(shape.batch, shape.heads, shape.queries, shape.dim)
    return q, k, v, grad, (shape.queries, shape.keys) if shape.lower_right else None


def _run(inputs, dtype, backends) -> list[torch.Tensor]:
    """Output and input gradients of one forward + backward of the runtime's call
    (`causal_sdpa` on the layout `_inputs` made)."""
    import warnings

    from .torch_attention import causal_sdpa

    q, k, v = (x.detach().to(dtype).requires_grad_() for x in inputs[:3])  # .to keeps the strides
    with sdpa_kernel(backends), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "... kernel not used because": the other backends are off by design
        out = causal_sdpa(q, k, v, lower_right=inputs[4])
        out.backward(inputs[3].to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _error(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((g.float() - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, reference))


def _time(fn, device, repeats: int) -> float:
    """Milliseconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) * 1e3 / repeats


def _agree(choice: AttentionChoice) -> AttentionChoice:
    """Every rank keeps the backend that is fastest on the slowest rank: the max of each
    backend's time over ranks (a backend refused anywhere counts as refused everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return choice
    names = list(BACKENDS)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    times = torch.tensor([choice.ms.get(n, float("inf")) for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    agreed = {n: float(t) for n, t in zip(names, times.tolist()) if t != float("inf")}
    for n in set(choice.ms) - set(agreed):
        choice.refused.setdefault(n, "refused on another rank")
    choice.ms = agreed
    choice.error = {n: e for n, e in choice.error.items() if n in agreed}
    choice.backend = min(agreed, key=agreed.get) if agreed else "default"
    return choice
