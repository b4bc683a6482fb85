"""Warnings and messages the stack prints that say nothing a gridwright user can act on, filtered.

Each entry names what it matches and why it does not apply. They are expected on every
machine this toolkit runs on, or on the machine kind named, and the README states the
facts they carry once (no Transformer Engine or Apex here; Megatron-Core's own
deprecations). Anything not listed still prints. The stack speaks four ways, and each
has its own narrow filter:

    EVERYWHERE, ON_CPU  Python warnings: (message regex, category, why)
    LOGGERS             a library logger's level: (logger, level, why)
    LOG_MESSAGES        one message of one logger: (logger, message regex, why)
    PRINTED             a line a library prints with print(), dropped only while the
                        call that prints it runs (`printed_lines_filtered`): (regex, why)
    NATIVE_STDERR       a line C++ writes to file descriptor 2, dropped only while the
                        call that writes it runs (`native_stderr_filtered`): (regex, why)
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings

EVERYWHERE = (
    ("Transformer Engine and Apex are not installed", UserWarning,
     "Megatron-Core uses its torch fallbacks; the README says so"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning,
     "the same fact, once per layer-spec module"),
    ("full scope is deprecated. Use empty cuda_graph_scope", UserWarning,
     "Megatron-Core 0.16.1's own TransformerConfig default (scope \"full\") triggers it; engine.cuda_graphs sets the empty scope itself"),
    (r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
     "called inside Megatron-Core and DeepSpeed, once per call site (hundreds of lines under ZeRO-3)"),
    ("`load_state_dict` is deprecated and will be removed in future versions", FutureWarning,
     "torch.distributed.checkpoint's deprecation, called inside Megatron-Core's checkpoint loading"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     "Megatron-Core 0.16.1's distributed checkpoints are built on ShardedTensor"),
    ("The pad token id in the tokenizer collides with another special token id", UserWarning,
     "gridwright's tokenizers pad with end-of-document; packed GPT samples have no padding to mask"),
    (r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated "
     "and will be removed in v6", FutureWarning,
     "transformers 5 renamed gradient checkpointing to activation checkpointing; gridwright calls the new "
     "names (an older gridwright read `is_gradient_checkpointing` and printed this on every DeepSpeed run), "
     "a caller written for transformers 4 still reaches the old ones, with nothing for a user to change"),
)
ON_CPU = (
    ("it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
     "a CUDA stream setting; the GPU launchers set it, a CPU run has no streams"),
)


# Loggers set to a level: (logger, level, why the messages below it do not apply).
LOGGERS = (
    ("torchao", logging.ERROR, "at import it reports its optional CUDA extensions (MXFP8, CUTLASS) that do not "
                               "load here; the float8 training gridwright uses is plain PyTorch"),
    ("torch.utils._pytree", logging.ERROR, "torchao 0.18 registers an Enum the way torch 2.11+ deprecates, once per "
                                           "process"),
    ("matplotlib.font_manager", logging.WARNING,
     "matplotlib builds its font cache the first time it is imported on a machine and says so at INFO; under "
     "Hydra's logging (INFO, on the terminal) a sweep's first plot printed `[HYDRA] generated new fontManager`. "
     "Its warnings (a font not found) still print"),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp", logging.WARNING,
     "Megatron-FSDP logs at INFO, when Megatron-Core is imported, what it detected (`Detected Megatron Core, "
     "using Megatron-FSDP with Megatron`, `Using Megatron-FSDP without Transformer Engine`), whether or not it "
     "is used; under Hydra's logging (INFO, on the terminal) `launcher=plan` with packed data, which imports "
     "Megatron-Core's scheduler, printed both. The plan names ZeRO-3 (Megatron-FSDP) itself"),
    ("hydra._internal.core_plugins.basic_launcher", logging.WARNING,
     "Hydra's local launcher logs `Launching N jobs locally` and each job's overrides; a sweep prints its own "
     "`point` line per point (gridwright.tracking.sweep)"),
)

# Single messages of one logger: (logger that emits it, message regex, why).
LOG_MESSAGES = (
    ("transformers.modeling_rope_utils",
     r"`rope_parameters`'s original_max_position_embeddings field must be less than max_position_embeddings",
     "Llama 3.1's rope scaling names the 8192 positions it was pre-trained on (families/llama.py); a model "
     "given fewer positions (the tiny models: 256) computes the same frequencies, which the converter's "
     "logits check compares with Megatron-Core's. Printed once per config object (twice per tiny model)"),
    ("DeepSpeed", r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it",
     "DeepSpeed 0.19.8 warns when it finds no GPU: the converter reads checkpoints on the CPU by design, and a "
     "training run names its device itself (cluster.device)"),
)

# Lines libraries print with print(): (regex, why). Dropped only around the call named.
PRINTED = (
    (r"^DeepSpeed deepspeed\.ops\.\S+ built successfully$",
     "DeepSpeed 0.19.8 prints it from every rank each time a C++ op loads, from torch's cache too "
     "(deepspeed/comm/torch.py, build_shm_op); gridwright says itself when an op is compiled and how long "
     "that took (engines.deepspeed_engine)"),
    (r"^(Processing zero checkpoint '|Detected checkpoint of type zero stage |Reconstructed (Frozen |Trainable )?fp32 "
     r"state dict with |Parsing checkpoint created by deepspeed==)",
     "DeepSpeed 0.19.8's zero_to_fp32 narrates each step of reassembling ZeRO partitions; the converter says "
     "what it read and wrote itself"),
    (r"Loading checkpoint shards: ",
     "the same reassembly's progress bar (tqdm, on stderr), over files read in well under a second"),
)

# Lines C++ writes straight to file descriptor 2: (regex, why). Dropped only around the call named.
NATIVE_STDERR = (
    (r"^USDT:\S+ \S+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)$",
     "libkineto marks the start and stop of every trace for USDT probes (a tracing hook for system tools), "
     "at a severity above ERROR, so torch's own suppression of kineto's messages lets it through; "
     "gridwright names the traced steps itself"),
)


class _MessageFilter(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def filter_known_warnings(device: str | None = None) -> None:
    """Install the filters (`device` 'cpu' adds the CPU-only ones)."""
    for name, level, _why in LOGGERS:
        logging.getLogger(name).setLevel(level)
    for name, pattern, _why in LOG_MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _MessageFilter) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_MessageFilter(pattern))
    for message, category, _why in EVERYWHERE + (ON_CPU if device == "cpu" else ()):
        warnings.filterwarnings("ignore", message=f".*{message}", category=category)


def _known(line: str, entries) -> bool:
    return any(re.search(pattern, line) for pattern, _why in entries)


class _LineFilter(io.TextIOBase):
    """A text stream that passes every whole line to `out` except those of `entries`."""

    def __init__(self, out, entries):
        self.out, self.entries, self.pending = out, entries, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not _known(line, self.entries):
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def close_pending(self) -> None:
        if self.pending and not _known(self.pending, self.entries):
            self.out.write(self.pending)
        self.pending = ""


@contextlib.contextmanager
def printed_lines_filtered():
    """Drop the PRINTED lines that Python code prints while this block runs; every other
    line passes, in order. sys.stdout and sys.stderr are wrapped, only for the block."""
    out, err = sys.stdout, sys.stderr
    filtered_out, filtered_err = _LineFilter(out, PRINTED), _LineFilter(err, PRINTED)
    try:
        with contextlib.redirect_stdout(filtered_out), contextlib.redirect_stderr(filtered_err):
            yield
    finally:
        filtered_out.close_pending()
        filtered_err.close_pending()
        out.flush()
        err.flush()


@contextlib.contextmanager
def native_stderr_filtered():
    """Drop the NATIVE_STDERR lines that C++ code writes to file descriptor 2 while this
    block runs: fd 2 goes to a file for the block, and every other line written meanwhile
    (Python's too) is written to the real fd 2 afterwards, in order. For short calls only:
    a line waits until the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                for line in held.read().decode(errors="replace").splitlines(keepends=True):
                    if not _known(line.rstrip("\n"), NATIVE_STDERR):
                        os.write(2, line.encode())
    finally:
        os.close(saved)
