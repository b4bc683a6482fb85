"""FP8 (torchao's, or Transformer Engine's) against bf16: the loss after N steps and the speed, side by side.

    python -m gridwright.evaluations.fp8_loss_check [--steps 200] [--recipes tensorwise rowwise]
        [--global-batch-size 8] [--lr 3e-4] [--data PREFIX] [--model llama3_8b --layers 8]
        [--runs-per-gpu 1] [--seeds 1234 1 2] [--layer-spec transformer_engine --recipes delayed tensorwise blockwise]

Runs the bench model once per precision, one GPU each at once (GPU 0 bf16, GPU 1 the first
FP8 recipe, and so on), in waves when there are more precisions than GPUs; a recipe written
`tensorwise+output` also puts the output layer in float8 (precision.fp8_output_layer; a recipe
without `+output` sets it false, whatever `auto` would choose).
`--runs-per-gpu K` runs K at once on each GPU: the losses are the same, the speeds then
are not comparable and the table leaves them out. `--seeds` runs every precision once per
seed (train.seed sets the weights and the data order): FP8 against bf16 then rests on a mean
over seeds and on each seed's difference from bf16 of the same seed, not on one run, whose
final loss moves by percents between repeats. Torch-native runs are compiled (torchao's
float8 casts are fast only compiled); `--layer-spec transformer_engine` builds TE's layers,
eager, under TE's recipes. Each seed's runs start from the same weights and data; it writes a table of the mean loss of the
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

from gridwright.config.schema import TrainConfig
from gridwright.evaluations.results_file import card_of_this_machine, write_markdown
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
    ap.add_argument("--layer-spec", choices=("torch_native", "transformer_engine"), default="torch_native",
                    help="torch_native: compiled layers, torchao's FP8; transformer_engine: TE's layers and recipes, "
                         "eager (TE's own fused kernels)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[TrainConfig.seed],
                    help="train.seed of each precision's runs; several give a mean and a spread")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    args = ap.parse_args()
    bad = [r for r in args.recipes if r.partition("+")[2] not in ("", "output")]
    if bad or args.runs_per_gpu < 1:
        what = f"recipe {bad[0]!r} (a recipe, or recipe+output)" if bad else "--runs-per-gpu below 1"
        print(f"error: {what}", file=sys.stderr)
        sys.exit(2)
    card, jobs = torch.cuda.get_device_name(0), Path(tempfile.mkdtemp(prefix="fp8_loss_"))
    precisions = ["bf16"] + [f"fp8_{r}" for r in args.recipes]
    runs = [(precision, seed) for seed in args.seeds for precision in precisions]  # a wave holds whole seeds
    slots = torch.cuda.device_count() * args.runs_per_gpu
    results = {}
    for wave in range(0, len(runs), slots):
        results |= run_wave(runs[wave:wave + slots], args, card, jobs)
    text = report(precisions, results, args, card, torch.__version__)
    print(text, flush=True)
    benchmark = "fp8_loss_check" + ("_te" if args.layer_spec == "transformer_engine" else "")
    write_markdown(args.out, benchmark, card_of_this_machine(),
                   "python -m gridwright.evaluations.fp8_loss_check " + " ".join(sys.argv[1:]), text)


LAYER_WORDS = {"torch_native": "compiled torch-native layers",
               "transformer_engine": "Transformer Engine's layers (eager)"}


def report(precisions: list[str], results: dict, args, card: str, torch_version: str) -> str:
    """The table (each precision's loss as a mean over seeds, each seed's loss, and each seed's
    difference from bf16 of the same seed, which shares its weights and data order) and the curves."""
    speeds = args.runs_per_gpu == 1
    what = " ".join(shape_and_data(args)) or "bench model, synthetic tokens"
    sharing = "" if speeds else f"; {args.runs_per_gpu} runs at once on each GPU, so no speeds"
    seeds = ", ".join(map(str, args.seeds))
    lines = [f"GPU: {card} (runs side by side{sharing}), torch {torch_version}; {what}, sequence 4096, "
             f"global batch {args.global_batch_size}, lr {args.lr} (warm-up 20 steps, cosine to a tenth), "
             f"{args.steps} steps, {LAYER_WORDS[args.layer_spec]}, seeds {seeds} (train.seed: weights and data order)",
             "",
             "| precision | spec | mean loss, last 10 steps (mean over seeds) | vs bf16 | by seed | vs bf16 of the "
             "same seed | tokens/s/GPU | vs bf16 | MFU (megatron; FP8 peak for FP8) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    bf16_runs = [results.get(("bf16", seed)) for seed in args.seeds]
    base = mean_row(bf16_runs)
    for precision in precisions:
        own = [results.get((precision, seed)) for seed in args.seeds]
        r = mean_row(own)
        if r is None:
            lines.append(f"| {precision} | failed | | | | | | | |")
            continue
        rel = f"{(r['loss10'] / base['loss10'] - 1):+.2%}" if base else ""
        by_seed = " / ".join("failed" if o is None else f"{o['loss10']:.4f}" for o in own)
        paired = " / ".join("" if o is None or b is None else f"{o['loss10'] / b['loss10'] - 1:+.2%}"
                            for o, b in zip(own, bf16_runs))
        speed = f"{r['tokens'] / base['tokens']:.2f}x" if base and speeds else ""
        mfu = "n/a" if r["mfu"] is None or not speeds else f"{r['mfu']:.1%}"
        tokens = f"{r['tokens']:,.0f}" if speeds else "shared GPU"
        lines.append(f"| {precision} | {r['spec']} | {r['loss10']:.4f} | {rel} | {by_seed} | {paired} | {tokens} "
                     f"| {speed} | {mfu} |")
    logged = min((len(r["losses"]) for r in results.values()), default=0)  # the same for every run of one call
    lines += ["", "Loss curve (mean over each tenth of the run, and over seeds):", "",
              "| precision | " + " | ".join(f"steps {a}-{b}" for a, b in tenths(logged)) + " |",
              "| --- " * (1 + len(tenths(logged))) + "|"]
    for precision in precisions:
        curves = [loss_curve(r["losses"][:logged]) for (p, _), r in results.items() if p == precision]
        if curves:
            lines.append(f"| {precision} | " + " | ".join(f"{sum(c) / len(curves):.3f}" for c in zip(*curves)) + " |")
    return "\n".join(lines)


def mean_row(rows: list[dict | None]) -> dict | None:
    """The mean of a precision's runs over seeds; None where any seed failed (a mean over fewer
    seeds than bf16's would not compare)."""
    if not rows or any(r is None for r in rows):
        return None
    mfus = [r["mfu"] for r in rows]
    return dict(loss10=sum(r["loss10"] for r in rows) / len(rows), tokens=sum(r["tokens"] for r in rows) / len(rows),
                mfu=None if None in mfus else sum(mfus) / len(mfus), spec=rows[0]["spec"])


def run_wave(runs: list[tuple[str, int]], args, card: str, jobs: Path) -> dict:
    """Run these (precision, seed) pairs at once, spread over the GPUs; their rows by pair."""
    import torch

    procs = {}
    for slot, (precision, seed) in enumerate(runs):
        recipe_preset, _, output = precision.partition("+")
        job = jobs / f"{precision.replace('+', '_')}_seed{seed}"
        cmd = [sys.executable, "-m", "gridwright", "+bench=bench_gpu", f"precision={recipe_preset}", "tracking=off",
               f"train.steps={args.steps}", f"train.global_batch_size={args.global_batch_size}",
               f"train.lr={args.lr}", f"train.min_lr={args.lr / 10}", "train.warmup_steps=20", f"train.seed={seed}",
               *spec_overrides(args.layer_spec), f"cluster.gpu.name={card.replace(' ', '_')}",
               f"job_dir={job}", *shape_and_data(args),
               f"precision.fp8_output_layer={str(output == 'output').lower()}"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(slot % torch.cuda.device_count())}
        print("+", " ".join(cmd), flush=True)
        procs[(precision, seed)] = job, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                         stderr=subprocess.STDOUT, text=True)
    rows = {}
    for run, (job, proc) in procs.items():
        out = proc.communicate()[0]
        if proc.returncode:
            print(out[-4000:], flush=True)
            continue
        s = json.loads((job / "summary.json").read_text())
        losses = [record["loss"] for record in read_metrics(job)]
        rows[run] = dict(loss10=sum(losses[-10:]) / 10, tokens=s["tokens_per_s_per_gpu"], mfu=s.get("mfu"),
                         spec=s.get("layer_spec"), losses=losses)
    return rows


def spec_overrides(layer_spec: str) -> list[str]:
    """Whose layers every run of the call builds: the torch-native spec compiled (torchao's
    float8 casts are fast only compiled), or Transformer Engine's, which does not compile."""
    if layer_spec == "transformer_engine":
        return ["engine.layer_spec=transformer_engine"]
    return ["engine.layer_spec=torch_native", "engine.compile_layers=true"]


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
