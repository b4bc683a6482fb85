"""Conversion speed and peak memory on a Llama-3-8B-shaped checkpoint, both directions.

    python -m gridwright.evaluations.bench_convert [--layers 32] [--work DIR] [--keep] [--train "OVERRIDES"]

Writes a randomly initialised bf16 Hugging Face folder of the Llama-3-8B shape (sharded
safetensors, written tensor by tensor so this script itself stays small), then times
`hf-to-megatron` and `megatron-to-hf`, each in a fresh process that reports its own
peak RSS (ru_maxrss). MB/s is the bf16 checkpoint size divided by the conversion's wall
time (imports excluded, the final rename included). The last step checks the round trip
bit for bit. With `--train`, the converted checkpoint is first trained from by
`launch.py` with the given overrides (e.g. on GPUs at TP=2), and the run's losses and
throughput are reported too. Results: a table on stdout, and evaluations/results/bench_convert_<card>.{md,json} (replacing the last call's).
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gridwright.evaluations.results_file import card_of_this_machine, write_json, write_markdown

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    dtype="bfloat16",
)
RESULTS = Path(__file__).resolve().parent / "results"


def write_random_llama(out: Path, layers: int, shard_bytes: int = 2 * 1024**3) -> int:
    """A random bf16 Llama-3-8B-shaped folder; returns its tensor bytes."""
    from gridwright.adapters.hf_files import StreamingSafetensorsWriter

    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                   (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    out.mkdir(parents=True)
    writer = StreamingSafetensorsWriter(out, [(n, s, torch.bfloat16) for n, s in shapes], shard_bytes)
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes:
        if len(shape) == 1:  # norms
            writer.add(name, torch.ones(shape, dtype=torch.bfloat16))
        else:
            writer.add(name, (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.finish()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return writer.total


def peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that across
    fork and exec, so a child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: best effort


def child(argv: list[str]) -> None:
    """Run one conversion in this process and print timing and peak RSS as JSON."""
    from gridwright.adapters.convert import main

    base = peak_rss_kib()  # after imports
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    peak = peak_rss_kib()
    print("RESULT " + json.dumps({"code": code, "seconds": seconds, "peak_rss_kib": peak, "import_rss_kib": base}))


def run_child(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "gridwright.evaluations.bench_convert", "--child", *argv],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"conversion failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if result["code"] != 0:
        raise RuntimeError(f"conversion exited {result['code']}:\n{proc.stderr[-3000:]}")
    return result


def train_from(checkpoint: Path, overrides: list[str], job_dir: Path) -> dict:
    """Train from a converted checkpoint with launch.py; summarise the run's metrics."""
    cmd = [sys.executable, "-m", "gridwright", f"hydra.searchpath=[file://{checkpoint}]", "model=hf",
           f"checkpoint.load={checkpoint}", f"job_dir={job_dir}", *overrides]
    print("+ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"training from the converted checkpoint failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = [json.loads(ln) for ln in (job_dir / "metrics.jsonl").read_text().splitlines()]
    later = steps[1:] or steps
    mean = lambda key: sum(s.get(key, 0.0) for s in later) / len(later)  # noqa: E731
    plan = proc.stdout.split("placement")[0]
    return {"overrides": overrides, "steps": len(steps), "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "tokens_per_s_per_gpu": mean("tokens_per_s_per_gpu"), "mfu": mean("mfu"),
            "memory_gib": max(s.get("memory_max_allocated_gib", 0.0) for s in steps),
            "layout_line": next((ln for ln in plan.splitlines() if ln.startswith("layout")), "")}


def same_tensors(a: Path, b: Path) -> bool:
    """Bit-for-bit comparison, one tensor at a time."""
    from gridwright.adapters.hf_files import SafetensorsSource

    sa, sb = SafetensorsSource(a), SafetensorsSource(b)
    if sa.names() != sb.names():
        return False
    return all(torch.equal(sa.get(n), sb.get(n)) for n in sorted(sa.names()))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch files")
    ap.add_argument("--no-save", action="store_true", help="print only; write no results file")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the results files go")
    ap.add_argument("--train", default=None, help="launch.py overrides (one quoted string): train from the "
                    "converted checkpoint before converting it back")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="gridwright-bench-convert-"))
    hf, meg, back, job = work / "hf", work / "megatron", work / "hf_back", work / "job"
    trained = None
    for p in (hf, meg, back, job):
        shutil.rmtree(p, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        size = write_random_llama(hf, args.layers)
        print(f"wrote a random bf16 Llama-3-8B-shaped folder, {args.layers} layers, {size / 1e9:.2f} GB "
              f"in {time.perf_counter() - t0:.0f} s")
        rows = []
        for direction, argv in (
            ("hf-to-megatron", ["hf-to-megatron", "--hf", str(hf), "--out", str(meg)]),
            ("megatron-to-hf", ["megatron-to-hf", "--megatron", str(meg), "--out", str(back)]),
        ):
            if direction == "megatron-to-hf" and args.train:
                trained = train_from(meg, shlex.split(args.train), job)
                print(f"trained from the converted checkpoint: {trained}", flush=True)
            r = run_child(argv)
            rows.append({"direction": direction, "gb": size / 1e9, "seconds": r["seconds"],
                         "mb_per_s": size / 1e6 / r["seconds"], "peak_rss_gib": r["peak_rss_kib"] / 1024**2,
                         "import_rss_gib": r["import_rss_kib"] / 1024**2})
        exact = same_tensors(hf, back)  # training reads the converted checkpoint, never writes it
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    header = "| direction | checkpoint GB | seconds | MB/s | peak RSS GiB | RSS after imports GiB |\n|---|---|---|---|---|---|"
    table = "\n".join([header] + [
        f"| {r['direction']} | {r['gb']:.2f} | {r['seconds']:.1f} | {r['mb_per_s']:.0f} | {r['peak_rss_gib']:.2f} "
        f"| {r['import_rss_gib']:.2f} |" for r in rows
    ])
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, Python {platform.python_version()}"
    if torch.cuda.is_available():
        machine += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(table)
    print(f"round trip bit-exact: {exact}   machine: {machine}")
    if not args.no_save:
        cmd = "python -m gridwright.evaluations.bench_convert" + (f" --layers {args.layers}" if args.layers != 32 else "")
        if args.train:
            cmd += f" --train {shlex.quote(args.train)}"
        if trained:
            table += (f"\n\nTrained from the converted checkpoint ({' '.join(trained['layout_line'].split()[1:])}): "
                      f"{trained['steps']} steps, loss {trained['first_loss']:.3f} -> {trained['last_loss']:.3f}, "
                      f"{trained['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {trained['mfu']:.1%}, "
                      f"peak memory {trained['memory_gib']:.1f} GiB/GPU (steps after the first averaged).")
        here = card_of_this_machine()
        write_markdown(args.out, "bench_convert", here, cmd,
                       f"Llama-3-8B shape ({args.layers} layers, bf16, random). Machine: {machine} (conversion runs "
                       f"on the CPU)\n\n{table}\n\nRound trip (HF -> Megatron-Core -> HF) bit-exact: {exact}\n\n"
                       "Each source was written just before it was converted, so its reads may partly come from the "
                       "page cache: MB/s measures the conversion, not a cold disk.",
                       title="Checkpoint conversion")
        write_json(args.out, "bench_convert", here,
                   {"layers": args.layers, "machine": machine, "rows": rows, "bit_exact": exact, "trained": trained})
    if exact is False:
        sys.exit(1)


if __name__ == "__main__":
    main()
