"""What a checkpoint save costs training: synchronous against background (`checkpoint.async_save`).

    python -m gridwright.evaluations.bench_checkpoint [--out DIR] [--models tiny larger] [--engines megatron deepspeed]

Each row is two `launch.py` runs of one engine and model, alike but for
`checkpoint.async_save`, each saving every few steps (per model). From the runs' summaries
(`checkpoint_saves`, one record per save and rank 0) it reports, per mode: the stall per
save (the time the step loop stood still: the whole write when synchronous; staging, the
fork and the publication in the background), the background write's time and MB/s, the
steps' mean time (a background write shares the machine's cores, and on CPU training's
first change to each page the writer still holds copies it), the host memory the staging
took (the processes' peak RSS against the synchronous run's), and the resume check: the
background run's last periodic checkpoint resumed, its losses against the uninterrupted
run's at every later step. The last save of a run is synchronous in both modes (nothing
trains after it) and is left out. Writes `results/bench_checkpoint_<card>.md`.

`larger` is a model whose synchronous save takes more than 2 s on the 2-core development
machine; `bench_1b` (1 GPU) is the bench model, which keeps one checkpoint (disk): its
resume check starts from the last periodic save.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gridwright.evaluations.results_file import card_of_this_machine, write_markdown

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evaluations" / "results"

# name: (overrides, save interval); the interval leaves a background write time to end
MODELS = {
    "tiny": (["train.steps=16"], 3),
    "larger": (["train.steps=10", "model.num_layers=8", "model.hidden_size=768", "model.ffn_hidden_size=2048",
                "model.num_attention_heads=12", "model.num_query_groups=12", "model.vocab_size=32000",
                "model.name=larger_llama"], 3),
    # one GPU: the bench model, 0.85 B, a 12 GiB checkpoint (the 8B shape's 74 GiB do not fit the
    # GPU machines' 64 GiB disk); bf16, ZeRO-1, sequence 4096
    "bench_1b": (["+bench=bench_gpu", "cluster=h100_x1", "train.steps=45", "checkpoint.keep_last=2"], 20),
}
GOAL = {"cpu": 0.20}  # the stall per background save, at most this share of the synchronous one's
GPU_GOAL = 0.10


def run(name: str, overrides: list[str], work: Path, env_extra: dict | None = None) -> dict:
    job = work / name
    cmd = [sys.executable, str(REPO / "launch.py"), "tracking=off", "train.warmup_steps=1", f"job_dir={job}",
           *overrides]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((job / "summary.json").read_text())
    losses = {json.loads(l)["step"]: json.loads(l)["loss"] for l in (job / "metrics.jsonl").read_text().splitlines()}
    return {"summary": summary, "losses": losses, "job": job, "stdout": done.stdout}


def periodic(saves: list[dict], background: bool) -> list[dict]:
    return [s for s in saves if s["background"] == background]


def row(engine: str, model: str, work: Path) -> dict:
    overrides, interval = MODELS[model]
    base = [f"engine={engine}", *overrides, f"checkpoint.save_interval={interval}"]
    out = {"engine": engine, "model": model}
    for mode in ("sync", "async"):
        ck = work / f"{engine}_{model}_{mode}_ck"
        got = run(f"{engine}_{model}_{mode}", base + [f"checkpoint.save={ck}",
                                                   f"checkpoint.async_save={str(mode == 'async').lower()}"], work)
        saves = got["summary"].get("checkpoint_saves", [])
        last = max(s["step"] for s in saves)
        kept = [s for s in saves if s["step"] != last]
        out[mode] = {
            "stall_s": statistics.median(s["stall_s"] for s in kept),
            "write_s": statistics.median(s.get("write_s", s["stall_s"]) for s in kept),
            "mb_per_s": statistics.median(s["bytes"] / 1e6 / s["write_s"] for s in kept if s.get("bytes"))
            if mode == "async" else None,
            "saves": len(kept),
            "step_s": got["summary"]["mean_step_time_s"],
            "staged_gib": max((s.get("staged_bytes") or 0) for s in kept) / 2**30 if mode == "async" else None,
            "losses": got["losses"],
            "ck": ck,
        }
        if mode == "sync":  # the synchronous write's size and speed; its checkpoints are not needed
            sizes = [s.get("bytes") for s in kept if s.get("bytes")]
            out[mode]["mb_per_s"] = statistics.median(sizes) / 1e6 / out[mode]["write_s"] if sizes else None
            shutil.rmtree(ck, ignore_errors=True)
    # Resume the background run's first checkpoint still there and compare every later step.
    a = out["async"]
    kept = sorted(int(p.name[5:]) for p in a["ck"].glob("iter_???????") if int(p.name[5:]) % interval == 0
                  and int(p.name[5:]) <= max(a["losses"]))
    resume_from = kept[0] - 1 if kept and kept[0] <= max(a["losses"]) else interval - 1
    (a["ck"] / "latest").write_text(f"iter_{resume_from + 1:07d}\n")
    resumed = run(f"{engine}_{model}_resumed", base + [f"checkpoint.load={a['ck']}"], work)
    diffs = [abs(resumed["losses"][s] - a["losses"][s]) for s in resumed["losses"]]
    out["resume"] = {"from_step": resume_from + 1, "steps": len(diffs), "max_abs_diff": max(diffs)}
    out["stall_ratio"] = out["async"]["stall_s"] / out["sync"]["stall_s"]
    for mode in ("sync", "async"):
        out[mode].pop("losses")
        shutil.rmtree(out[mode].pop("ck"), ignore_errors=True)
    return out


def table(rows: list[dict], goal: float) -> str:
    head = ("| engine | model | save (sync) | stall per save: sync | async | async / sync | background write s "
            "| write MB/s: sync | async | mean step s: sync | async | staged copies GiB "
            "| resumed: steps, max loss diff |\n" + "| --- " * 13 + "|\n")
    lines = []
    for r in rows:
        s, a = r["sync"], r["async"]

        def f(v, fmt):
            return "" if v is None else format(v, fmt)
        lines.append(
            f"| {r['engine']} | {r['model']} | {s['saves']} saves | {s['stall_s']:.2f} s | {a['stall_s']:.3f} s "
            f"| {r['stall_ratio']:.1%} | {a['write_s']:.2f} | {f(s['mb_per_s'], '.0f')} | {f(a['mb_per_s'], '.0f')} "
            f"| {f(s['step_s'], '.3f')} | {f(a['step_s'], '.3f')} | {f(a['staged_gib'], '.2f')} | from {r['resume']['from_step']}: {r['resume']['steps']}, "
            f"{r['resume']['max_abs_diff']:.1e} |")
    met = all(r["stall_ratio"] <= goal and r["resume"]["max_abs_diff"] == 0.0 for r in rows)
    return head + "\n".join(lines) + (f"\n\nGoal: the stall per background save at most {goal:.0%} of the "
                                      f"synchronous one's, and resumed losses identical: "
                                      f"{'met' if met else 'NOT MET'}.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--models", nargs="*", default=["tiny", "larger"])
    ap.add_argument("--engines", nargs="*", default=["megatron", "deepspeed"])
    args = ap.parse_args(argv)
    card = card_of_this_machine()
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        rows = [row(engine, model, work) for engine in args.engines for model in args.models]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goal = GOAL.get(card, GPU_GOAL)
    text = ("Stall: the time the step loop stood still per periodic save (median); the last save, "
            "synchronous in both modes, is left out. Staged copies: how much rank 0's training process "
            "grew at the staging (its copies of GPU tensors in host memory; on CPU the writer's fork shares "
            "the pages instead, and training's changes during the write copy them: up to the rank's part "
            "of the checkpoint, not measured here). Mean step: over the run, saves excluded; a background "
            "write shares the host's cores with training.\n\n" + table(rows, goal))
    print(text)
    cmd = "python -m gridwright.evaluations.bench_checkpoint " + " ".join(sys.argv[1:])
    write_markdown(args.out, "bench_checkpoint", card, cmd.strip(), text, title="Checkpoint saves: synchronous and in the background")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
