"""FP8 through torchao against bf16: the loss after N steps and the speed, side by side.

    python -m gridwright.evaluations.fp8_loss_check [--steps 200] [--recipes tensorwise rowwise]
        [--global-batch-size 8] [--lr 3e-4] [--data PREFIX] [--model llama3_8b --layers 8]
        [--runs-per-gpu 1]

Runs the bench model once per precision, one GPU each at once (GPU 0 bf16, GPU 1 the first
FP8 recipe, and so on), in waves when there are more precisions than GPUs; a recipe written
`tensorwise+output` also puts the output layer in float8 (precision.fp8_output_layer).
`--runs-per-gpu K` runs K at once on each GPU: the losses are the same, the speeds then
are not comparable and the table leaves them out. All runs are compiled (torchao's float8
casts are fast only compiled), from the same seed and data, and it writes a table of the mean loss of the
last 10 steps, its difference from bf16, and tokens/s against bf16, then the loss curves
(mean of each tenth of the run). `--data` trains on a dataset made by
`python -m gridwright.data.prepare_data` (real text, whose loss does not fall towards
zero as the synthetic stream's does) instead of the synthetic tokens; `--model` and
`--layers` put another shape in place of the bench model (the Llama-3-8B shape, where
GEMMs dominate, fits one GPU at 8 layers). The curve is there because a comparison at one step
means little unless bf16 itself is still descending there: a run whose bf16 loss has
turned upward (too high a learning rate for the batch) compares two unstable runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gridwright.evaluations.results_file import write_markdown
from gridwright.runtime.jobdir import read_metrics

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--recipes", nargs="*", default=["tensorwise"])
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--data", type=Path, help="an indexed dataset's prefix (prepare_data's --output-prefix)")
    ap.add_argument("--model", help="a model config (conf/model) in place of the bench model")
    ap.add_argument("--layers", type=int, help="model.num_layers")
    ap.add_argument("--runs-per-gpu", type=int, default=1, help="runs at once on each GPU (losses only)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    args = ap.parse_args()
    bad = [r for r in args.recipes if r.partition("+")[2] not in ("", "output")]
    if bad or args.runs_per_gpu < 1:
        what = f"recipe {bad[0]!r} (a recipe, or recipe+output)" if bad else "--runs-per-gpu below 1"
        print(f"error: {what}", file=sys.stderr)
        sys.exit(2)
    card, jobs = torch.cuda.get_device_name(0), Path(tempfile.mkdtemp(prefix="fp8_loss_"))
    precisions = ["bf16"] + [f"fp8_{r}" for r in args.recipes]
    slots = torch.cuda.device_count() * args.runs_per_gpu
    rows = {}
    for wave in range(0, len(precisions), slots):
        rows |= run_wave(precisions[wave:wave + slots], args, card, jobs)
    base = rows.get("bf16")
    speeds = args.runs_per_gpu == 1
    what = " ".join(shape_and_data(args)) or "bench model, synthetic tokens"
    sharing = "" if speeds else f"; {args.runs_per_gpu} runs at once on each GPU, so no speeds"
    lines = [f"GPU: {card} (runs side by side{sharing}), torch {torch.__version__}; {what}, sequence 4096, "
             f"global batch {args.global_batch_size}, lr {args.lr} (warm-up 20 steps, cosine to a tenth), "
             f"{args.steps} steps, compiled layers", "",
             "| precision | spec | mean loss, last 10 steps | vs bf16 | tokens/s/GPU | vs bf16 | MFU (megatron; FP8 peak for FP8) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for precision in precisions:
        r = rows.get(precision)
        if r is None:
            lines.append(f"| {precision} | failed | | | | | |")
            continue
        rel = f"{(r['loss10'] / base['loss10'] - 1):+.2%}" if base else ""
        speed = f"{r['tokens'] / base['tokens']:.2f}x" if base and speeds else ""
        mfu = "n/a" if r["mfu"] is None or not speeds else f"{r['mfu']:.1%}"
        tokens = f"{r['tokens']:,.0f}" if speeds else "shared GPU"
        lines.append(f"| {precision} | {r['spec']} | {r['loss10']:.4f} | {rel} | {tokens} | {speed} | {mfu} |")
    logged = min((len(r["losses"]) for r in rows.values()), default=0)  # the same for every run of one call
    lines += ["", "Loss curve (mean over each tenth of the run):", "",
              "| precision | " + " | ".join(f"steps {a}-{b}" for a, b in tenths(logged)) + " |",
              "| --- " * (1 + len(tenths(logged))) + "|"]
    lines += [f"| {p} | " + " | ".join(f"{v:.3f}" for v in loss_curve(rows[p]["losses"][:logged])) + " |"
              for p in precisions if p in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    write_markdown(args.out, "fp8_loss_check", "python -m gridwright.evaluations.fp8_loss_check " + " ".join(sys.argv[1:]),
                   text)


def run_wave(precisions: list[str], args, card: str, jobs: Path) -> dict:
    """Run these precisions at once, spread over the GPUs; their rows by precision."""
    import torch

    procs = {}
    for slot, precision in enumerate(precisions):
        recipe_preset, _, output = precision.partition("+")
        cmd = [sys.executable, "-m", "gridwright", "+experiment=bench_gpu", f"precision={recipe_preset}", "tracking=off",
               f"train.steps={args.steps}", f"train.global_batch_size={args.global_batch_size}",
               f"train.lr={args.lr}", f"train.min_lr={args.lr / 10}", "train.warmup_steps=20",
               "engine.compile_layers=true", f"cluster.gpu.name={card.replace(' ', '_')}",
               f"job_dir={jobs / precision.replace('+', '_')}", *shape_and_data(args),
               *(["precision.fp8_output_layer=true"] if output == "output" else [])]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(slot % torch.cuda.device_count())}
        print("+", " ".join(cmd), flush=True)
        procs[precision] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = {}
    for precision, proc in procs.items():
        out = proc.communicate()[0]
        if proc.returncode:
            print(out[-4000:], flush=True)
            continue
        job = jobs / precision.replace("+", "_")
        s = json.loads((job / "summary.json").read_text())
        losses = [record["loss"] for record in read_metrics(job)]
        rows[precision] = dict(loss10=sum(losses[-10:]) / 10, tokens=s["tokens_per_s_per_gpu"], mfu=s.get("mfu"),
                               spec=s.get("layer_spec"), losses=losses)
    return rows


def shape_and_data(args) -> list[str]:
    """The overrides of --model, --layers and --data."""
    out = [f"model={args.model}"] if args.model else []
    out += [f"model.num_layers={args.layers}"] if args.layers else []
    if args.data:
        out += ["data.kind=indexed", f"data.paths=[{args.data.resolve()}]"]
    return out


def tenths(steps: int) -> list[tuple[int, int]]:
    """1-based inclusive step ranges of the ten tenths of a run (fewer for short runs)."""
    edges = sorted({round(steps * k / 10) for k in range(11)})
    return [(a + 1, b) for a, b in zip(edges, edges[1:])]


def loss_curve(losses: list[float]) -> list[float]:
    return [sum(losses[a - 1:b]) / (b - a + 1) for a, b in tenths(len(losses))]


if __name__ == "__main__":
    main()
