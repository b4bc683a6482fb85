"""The correctness gate of a conversion: Hugging Face and Megatron-Core logits on the same tokens.

The Hugging Face model runs in this process through `transformers` (fp32, CPU); the
Megatron-Core model runs in `tp x pp x ep` processes over gloo (logits_worker), built
and loaded as the engine would at that layout. Both see the same random tokens.

A conversion that casts (`--dtype bf16` of an fp32 checkpoint) compares like with like:
both sides' weights are rounded to that dtype, then both compute in fp32, so the
tolerance measures the mapping and not the cast (the cast's own error, e.g. 3e-2 on the
logits of a tiny model in bf16, would otherwise hide a mapping error of that size).

A check takes half a minute on a tiny model and longer on a real one, most of it in the
Megatron-Core processes, which each import Megatron-Core before they load anything. With
`progress`, each side prints one line as it starts, with an estimate for the Megatron-Core
side (`megatron_side_estimate_s`: the processes' measured start-up time, shared between the
cores and the machine's load, plus the Hugging Face side's measured time for the same
weights), and its measured time when it ends.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..checkpoints.logits_digest import sample_tokens
from ..runtime.loopback import LOOPBACK, LOOPBACK_SOCKETS, free_port
from ..runtime.process_tree import run_bounded
from .megatron_files import find_checkpoint


def round_weights(module: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Round every fp32 parameter to `dtype` and back (what a cast to `dtype` stores)."""
    if dtype is None:
        return
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the check prints its own stage lines
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    round_weights(model, round_to)
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(checkpoint_dir: str | Path, tokens: torch.Tensor, tp=1, pp=1, vpp=None, ep=1,
                    model: dict | None = None, round_to: str | None = None,
                    layer_spec: str = "torch_native", timeout: float | None = None) -> torch.Tensor:
    """Logits of the Megatron-Core model at this layout; `model` overrides the model config
    the checkpoint records (needed for checkpoints that record none); `layer_spec`
    transformer_engine builds TE's layers, on the GPU; `timeout`: seconds after which the
    processes are stopped and the error carries what they printed."""
    _, iteration = find_checkpoint(Path(checkpoint_dir))
    with tempfile.TemporaryDirectory(prefix="gridwright-logits-") as tmp:
        tok_file, out_file = Path(tmp) / "tokens.pt", Path(tmp) / "logits.pt"
        torch.save(tokens, tok_file)
        model_args = []
        if model is not None:
            (Path(tmp) / "model.json").write_text(json.dumps(model))
            model_args = ["--model", str(Path(tmp) / "model.json")]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={tp * pp * ep}",
            f"--master_addr={LOOPBACK}", f"--master_port={free_port()}",
            "-m", "gridwright.adapters.logits_worker", "--checkpoint", str(iteration),
            "--tokens", str(tok_file), "--out", str(out_file),
            "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
        ] + (["--vpp", str(vpp)] if vpp else []) + model_args + (["--round-to", round_to] if round_to else [])
        cmd += ["--layer-spec", layer_spec]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **LOOPBACK_SOCKETS)
        # bounded as a tree: a hung worker is ended with its torchrun, and cannot hold the pipes
        proc = run_bounded(cmd, timeout, grace_s=10, env=env)
        if proc.returncode == 124 and timeout is not None:
            printed = proc.stdout + proc.stderr
            raise RuntimeError(f"the Megatron-Core logits run did not end within {timeout:g} s:\n{printed[-4000:]}")
        if proc.returncode != 0:
            raise RuntimeError(f"the Megatron-Core logits run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return torch.load(out_file)


ROUNDING = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Seconds one logits process takes to start before it reads a weight: Python, torch and
# Megatron-Core imported, measured alone on the 2-core CI machine (7 s); and torchrun's own
# start (2 s). The processes share the machine's cores.
WORKER_START_S = 7.0
TORCHRUN_START_S = 2.0


def weights_bytes(hf_dir: str | Path) -> int:
    """Bytes of a Hugging Face folder's safetensors files."""
    return sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors"))


def megatron_side_estimate_s(processes: int, hf_side_s: float, cores: int, busy: float = 0.0) -> float:
    """Seconds the Megatron-Core side of a check should take: its processes' start, sharing
    `cores` with `busy` other runnable processes (the load average), then the same weights
    loaded and run as the Hugging Face side just did (its measured time)."""
    shares = max(math.ceil(processes / cores), (processes + busy) / cores)
    return TORCHRUN_START_S + WORKER_START_S * shares + hf_side_s


def other_load() -> float:
    """Runnable processes besides this one (the 1-minute load average, less this process,
    which has just been busy with the Hugging Face side)."""
    return max(0.0, os.getloadavg()[0] - 1.0)


@contextlib.contextmanager
def stage(text: str, show: bool):
    """One progress line: `text` as the stage starts, its measured time appended at its end."""
    started = time.perf_counter()
    if show:
        print(f"verify: {text} ...", end="", flush=True)
    ok = False
    try:
        yield
        ok = True
    finally:
        if show:
            print(f" {time.perf_counter() - started:.1f} s" if ok else " failed", flush=True)


def compare_logits(hf_dir, megatron_dir, tp=1, pp=1, vpp=None, ep=1, batch=2, seq=16, model=None,
                   round_to: str | None = None, progress: bool = False) -> dict:
    """Max |difference| of the two models' logits on the same tokens (fp32 compute, CPU);
    `round_to` ('bf16', 'fp16') rounds both sides' weights to that dtype first. `progress`
    prints a line per side (what it does, the estimate, the time it took)."""
    from ..planning.disk_space import size_text

    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    tokens = sample_tokens(vocab, batch, seq * tp)  # SP splits the sequence over TP
    started = time.perf_counter()
    with stage(f"Hugging Face side (1/2): {size_text(weights_bytes(hf_dir))} of weights into transformers, "
               f"forward on {tokens.shape[0]} x {tokens.shape[1]} tokens", progress):
        ref = hf_logits(hf_dir, tokens, ROUNDING.get(round_to))
    processes, cores = tp * pp * ep, len(os.sched_getaffinity(0))
    estimate = megatron_side_estimate_s(processes, time.perf_counter() - started, cores, other_load())
    with stage(f"Megatron-Core side (2/2): {processes} process{'es' if processes > 1 else ''} at TP={tp} PP={pp} "
               f"EP={ep} on {cores} CPU core{'s' if cores > 1 else ''}, est. {estimate:.0f} s", progress):
        got = megatron_logits(megatron_dir, tokens, tp, pp, vpp, ep, model,
                              round_to if round_to in ROUNDING else None)
    if got.shape != ref.shape:
        raise RuntimeError(f"logits shapes differ: Hugging Face {tuple(ref.shape)}, Megatron-Core {tuple(got.shape)}")
    diff = (got - ref).abs()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "max_abs_logit": float(ref.abs().max()), "tokens": list(tokens.shape),
            "layout": {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep},
            "weights": f"both sides rounded to {round_to}, computed in fp32" if round_to in ROUNDING
            else "as stored, computed in fp32"}
