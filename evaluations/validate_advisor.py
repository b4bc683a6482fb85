"""The step-time model against the measured GPU rows it was not fitted on.

    python -m gridwright.evaluations.validate_advisor          # predicted against measured, per row
    python -m gridwright.evaluations.validate_advisor --fit    # refit the calibration, then the same

The calibration (`gridwright/planning/step_time_calibration.json`) is fitted from the rows
named in CALIBRATION only; every other committed GPU row of the Megatron engine on the
torch-native spec is the test set: the bench_gpu results files (each case's config is
composed from bench_gpu's own overrides) and the recorded sweeps in tests/data/sweeps
(their config.yaml). Per row it prints predicted against measured step time, compute,
exposed communication per group and idle time (against the predicted bubble; idle also
holds host waits), and per call the share of layout pairs the prediction orders right.
Torch-free.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from itertools import combinations
from pathlib import Path

from gridwright.config.compose import compose_config
from gridwright.engine_rules.registry import rules
from gridwright.planning.comm_model import CommProfile
from gridwright.planning.layout import ParallelLayout
from gridwright.planning.model_math import forward_flops_parts, param_counts
from gridwright.planning.step_time import (ADAM_BYTES_PER_PARAM, CALIBRATION_FILE, CardSpeeds, load_calibration,
                                           predict_step, rate_kind, speeds_for)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evaluations" / "results"
SWEEPS = REPO / "tests" / "data" / "sweeps"
ADVICE = REPO / "tests" / "data" / "advice"  # advise.json files of launcher.verify runs on a GPU
COMMON = ["tracking=off", "precision=bf16"]  # bench_gpu's own, less its learning-rate schedule

# The rows the calibration is fitted from, by what each fits: {role: (file, case, what)};
# nothing else. The kernel-rate rows give GEMM, attention and rest times per precision kind.
CALIBRATION = {
    "bf16": ("bench_gpu_performance_1xh200.md", "llama3_8b_16l_1gpu_mb2",
             "bf16 GEMM, attention and compiled rest rates"),
    "fp8": ("bench_gpu_performance_1xh200.md", "llama3_8b_16l_1gpu_mb2_fp8_tensorwise_output",
            "FP8 GEMM and compiled rest rates"),
    "te_fp8": ("bench_gpu_te_1xh200.md", "llama3_8b_16l_1gpu_mb2_te_fp8_delayed_graphs",
               "Transformer Engine's FP8 GEMM and rest rates (its own layers asked for)"),
    "eager": ("bench_gpu_performance_2xh200.md", "bench_1b_1gpu_base", "the eager (uncompiled) rest rate"),
    "cp": ("bench_gpu_performance_2xh200.md", "bench_1b_cp2_mb4", "the share of CP's ring exchange attention hides"),
    "nvlink": ("comm_profile_2xh100.json", None, "NVLink α-β of every collective (two-GPU groups)"),
}
KERNEL_RATE_ROLES = ("bf16", "fp8", "te_fp8")
HOST_S_PER_KERNEL = 5e-6  # not fitted: no calibration row is host-bound (their host wait is under 1 %)
H200_HBM_TBPS, H100_HBM_TBPS = 4.8, 3.35  # published HBM bandwidths


# Reading results files ----------------------------------------------------------------------
def bench_gpu_rows(path: Path) -> tuple[str, list[dict]]:
    """The card ("H200") and the main table's rows of a bench_gpu results file, by column name."""
    text = path.read_text()
    card = re.search(r"^GPU: \d+ x NVIDIA (\w+)", text, re.M)[1]
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("| "):
            header = None if not line.strip() else header
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "case":
            header = cells if "step s" in cells else None
        elif header and not set(line) <= set("|- ") and len(cells) == len(header):
            rows.append(dict(zip(header, cells)))
    return card, rows


def number(cell: str) -> float | None:
    cell = cell.replace(",", "").strip()
    return float(cell) if cell else None


def bench_gpu_cases() -> dict:
    from gridwright.evaluations.bench_gpu import SUITES

    return SUITES["all"]


def compose_case(name: str) -> object:
    _, overrides = bench_gpu_cases()[name]
    return compose_config(COMMON + overrides)


def layout_of(cfg) -> ParallelLayout:
    return ParallelLayout.from_config(cfg)


# Fitting --------------------------------------------------------------------------------------
def _row(file: str, case: str) -> tuple[str, dict]:
    card, rows = bench_gpu_rows(RESULTS / file)
    return card, next(r for r in rows if r["case"] == case)


def _shape(cfg):
    layout = layout_of(cfg)
    m, t = cfg.model, cfg.train
    micro = layout.accumulation(t)
    tokens = micro * t.micro_batch_size * t.seq_length
    return layout, tokens, micro, forward_flops_parts(m, t.seq_length, param_counts(m))


def fit() -> dict:
    """The calibration, from the CALIBRATION rows only."""
    rates, other, kernels = {}, {}, []
    attention_tflops = None
    for file, case, _ in (CALIBRATION[role] for role in KERNEL_RATE_ROLES):
        card, row = _row(file, case)
        cfg = compose_case(case)
        layout, tokens, micro, parts = _shape(cfg)
        layers, h = cfg.model.num_layers, cfg.model.hidden_size
        matmul_ms, attention_ms, other_ms = (float(x) for x in row["matmul / attention / other ms"].split("/"))
        kind = rate_kind(cfg)
        rates[kind] = tokens * 3 * (layers * parts["layer_matmul"] + parts["output"]) / (matmul_ms / 1e3) / 1e12
        if kind == "bf16":
            attention_tflops = tokens * 3 * layers * parts["layer_attention"] / (attention_ms / 1e3) / 1e12
        pc = param_counts(cfg.model)
        optimizer_s = (pc.total - pc.embedding) * ADAM_BYTES_PER_PARAM / (H200_HBM_TBPS * 1e12)
        other[kind] = (other_ms / 1e3 - optimizer_s) / (tokens * h * layers)
        if not kind.startswith("te_"):  # TE's CUDA graphs launch fewer kernels than a run without them
            kernels.append(number(row["kernels"]) / (micro * layers))
    speeds = CardSpeeds(card="H200", matmul_tflops=rates, attention_tflops=attention_tflops,
                        other_s_per_unit=other, memory_tbps=H200_HBM_TBPS, host_s_per_kernel=HOST_S_PER_KERNEL,
                        kernels_per_layer=statistics.mean(kernels), nvlink=nvlink_fits(), fitted_from=[], notes=[])
    # The eager rest: the uncompiled row's step less what the compiled rates predict for the rest
    file, case, _ = CALIBRATION["eager"]
    _, row = _row(file, case)
    cfg = compose_case(case)
    layout, tokens, micro, parts = _shape(cfg)
    other["bf16_eager"] = 0.0  # the rest predicted as nothing: the row's remainder is the rest
    predicted = predict_step(cfg, layout, speeds)
    known = predicted.step_s - predicted.parts["other"]
    other["bf16_eager"] = (number(row["step s"]) - known) / (tokens * cfg.model.hidden_size * cfg.model.num_layers)
    # CP's ring: the share hidden is what the measured exposed time leaves of the α-β time
    file, case, _ = CALIBRATION["cp"]
    _, row = _row(file, case)
    cfg = compose_case(case)
    ring = predict_step(cfg, layout_of(cfg), speeds).communication["cp"]["seconds"]
    hidden = min(1.0, max(0.0, 1.0 - number(row["exposed cp ms"]) / 1e3 / ring))
    h200 = dict(speeds.__dict__, other_s_per_unit=other, cp_ring_hidden=hidden,
                fitted_from=[f"{f}{'' if c is None else ': ' + c} ({what})" for f, c, what in CALIBRATION.values()],
                notes=[f"host seconds per kernel launch assumed {HOST_S_PER_KERNEL * 1e6:.0f} µs (no calibration "
                       "row is host-bound)", "NVLink α-β measured on 2 x H100 (NVLink 4, as H200's)"])
    ratio = H200_HBM_TBPS / H100_HBM_TBPS
    h100 = dict(h200, card="H100", memory_tbps=H100_HBM_TBPS,
                other_s_per_unit={k: v * ratio for k, v in other.items()},
                notes=h200["notes"] + [f"derived from H200's: the same GEMM and attention rates (same SMs and "
                                       f"clocks), the memory-bound rest {ratio:.2f} x slower (HBM "
                                       f"{H100_HBM_TBPS} against {H200_HBM_TBPS} TB/s)"])
    return {"format": "gridwright-step-time-calibration/1", "cards": [h200, h100]}


def nvlink_fits() -> dict:
    profile = CommProfile.load(RESULTS / "comm_profile_2xh100.json")
    return {coll: {"alpha_s": sizes[2].alpha_s, "beta_s_per_byte": sizes[2].beta_s_per_byte}
            for coll, sizes in profile.fits.items() if 2 in sizes}


# The test set -----------------------------------------------------------------------------------
def calibration_cases() -> set[tuple[str, str]]:
    return {(f, c) for f, c, _ in CALIBRATION.values() if c}


def out_of_scope(cfg, spec: str) -> str | None:
    """Why the model does not predict this row (None: it does); `spec`: the layer spec the
    row ran, as it recorded it."""
    if not rules(cfg.engine).CAPABILITIES.models_communication:
        return f"the {cfg.engine.name} engine (the model's communication is Megatron-Core's)"
    if not spec.startswith("local"):
        return "Transformer Engine's layers (one calibration row; none is left to test them on)"
    if cfg.data.packing:
        return "packed documents (attention by document length is not modelled)"
    return None


def test_rows() -> tuple[list[dict], list[dict]]:
    """(rows, skipped): each row a measured step with its config, card and call."""
    rows, skipped = [], []
    cases = bench_gpu_cases()
    for path in sorted(RESULTS.glob("bench_gpu_*.md")):
        card, table = bench_gpu_rows(path)
        for row in table:
            name = row["case"]
            if name in {case for _, case in calibration_cases()}:  # its config, in any call, is fitted on
                skipped.append({"row": f"{path.name}: {name}", "why": "a calibration case: fitted on"})
                continue
            if name not in cases:
                skipped.append({"row": f"{path.name}: {name}", "why": "not a bench_gpu case any more"})
                continue
            cfg = compose_case(name)
            why = out_of_scope(cfg, row["spec"])
            if why:
                skipped.append({"row": f"{path.name}: {name}", "why": why})
                continue
            exposed = {g: number(row.get(f"exposed {g} ms", "") or "") for g in ("tp", "cp", "dp", "pp", "ep")}
            rows.append({"call": path.name, "name": name, "card": card, "cfg": cfg,
                         "step_s": number(row["step s"]),
                         "compute_s": None, "idle_s": (number(row.get("idle ms", "") or "") or 0.0) / 1e3,
                         "exposed_s": {g: v / 1e3 for g, v in exposed.items() if v is not None}})
    for sweep in sorted(p for p in SWEEPS.iterdir() if p.is_dir()):
        for point in sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file()):
            from omegaconf import OmegaConf

            from gridwright.config.compose import strip_hydra

            cfg = strip_hydra(OmegaConf.load(point / "config.yaml"))
            summary = json.loads((point / "summary.json").read_text())
            why = out_of_scope(cfg, summary.get("layer_spec", "local"))
            name = f"{sweep.name}/{point.name}"
            if why:
                skipped.append({"row": name, "why": why})
                continue
            comm = summary.get("communication") or {}
            rows.append({"call": sweep.name, "name": name, "card": cfg.cluster.gpu.name, "cfg": cfg,
                         "step_s": summary["mean_step_time_s"], "compute_s": comm.get("compute_s"),
                         "idle_s": comm.get("idle_s"),
                         "exposed_s": {g: v["exposed_s"] for g, v in (comm.get("by_group") or {}).items()}})
    return rows, skipped


def predicted_rows(rows: list[dict], calibration: list[CardSpeeds]) -> list[dict]:
    for row in rows:
        cfg = row["cfg"]
        p = predict_step(cfg, layout_of(cfg), speeds_for(row["card"], calibration))
        row["predicted"] = p
        row["error"] = p.step_s / row["step_s"] - 1
    return rows


def pair_order(rows: list[dict]) -> tuple[int, int]:
    """(right, pairs) over pairs of rows of one call whose measured steps differ by 2 % or more."""
    right = pairs = 0
    for call in {r["call"] for r in rows}:
        one = [r for r in rows if r["call"] == call]
        for a, b in combinations(one, 2):
            if abs(a["step_s"] / b["step_s"] - 1) < 0.02:
                continue
            pairs += 1
            right += (a["step_s"] < b["step_s"]) == (a["predicted"].step_s < b["predicted"].step_s)
    return right, pairs


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.0f} %"


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.0f}"


def report(rows: list[dict], skipped: list[dict]) -> str:
    lines = ["| call | row | card | layout | step s measured | predicted | error | compute ms measured / "
             "predicted | exposed comm ms measured / predicted, per group | idle ms measured / bubble predicted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        p, lay = r["predicted"], layout_of(r["cfg"])
        compute = p.parts["matmul"] + p.parts["attention"] + p.parts["other"] + p.parts["optimizer"]
        groups = sorted(set(r["exposed_s"]) | set(p.communication))
        comm = ", ".join(f"{g} {_ms(r['exposed_s'].get(g))} / {_ms(p.communication.get(g, {}).get('exposed_s', 0.0))}"
                         for g in groups)
        lines.append(f"| {r['call']} | {r['name'].split('/')[-1]} | {r['card']} | {lay.slug()} | {r['step_s']:.3f} "
                     f"| {p.step_s:.3f} | {_pct(r['error'])} | {_ms(r['compute_s'])} / {_ms(compute)} | {comm} "
                     f"| {_ms(r['idle_s'])} / {_ms(p.parts['bubble'])} |")
    errors = [abs(r["error"]) for r in rows]
    right, pairs = pair_order(rows)
    lines += ["", f"Rows: {len(rows)}; median |error| of the step time: {statistics.median(errors) * 100:.1f} % "
              f"(goal ≤ 15 %); within 15 %: {sum(e <= 0.15 for e in errors)}.",
              f"Pairs of one call ordered right: {right} of {pairs} ({right / max(1, pairs) * 100:.0f} %, "
              "goal ≥ 85 %; pairs within 2 % of each other measured are not counted)."]
    if skipped:
        lines += ["", "Not predicted:"] + [f"- {s['row']}: {s['why']}" for s in skipped]
    return "\n".join(lines)


# Megatron-Bridge's published DGX-H100 pretraining rows (docs/performance-summary-archive.md
# of NVIDIA-NeMo/Megatron-Bridge at 067f987: the newest table with H100 rows is 26.06; the
# Llama-3 8B and 70B rows are from the newest tables that have them). FP8 is its current
# scaling (FP8-CS), which is gridwright's precision=fp8_tensorwise; FSDP8 is DP=8 with
# Megatron-FSDP. Qwen3-30B-A3B and Nemotron-3-Nano (26.06) have no gridwright model preset.
PUBLISHED = [
    {"release": "25.11", "model": "llama3_8b", "gpus": 8, "gbs": 128, "mbs": 1, "seq": 8192,
     "layout": {"parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.vpp": None, "zero": "stage3"},
     "tokens_per_s_per_gpu": 14451},
    {"release": "26.04.01", "model": "llama3_70b", "gpus": 64, "gbs": 256, "mbs": 1, "seq": 8192,
     "layout": {"parallel.tp": 4, "parallel.pp": 8, "parallel.cp": 1, "parallel.vpp": 5, "zero": "stage1"},
     "tokens_per_s_per_gpu": 1664},
    {"release": "26.06", "model": "llama3_405b", "gpus": 1024, "gbs": 1536, "mbs": 1, "seq": 8192,
     "layout": {"parallel.tp": 8, "parallel.pp": 8, "parallel.cp": 2, "parallel.vpp": 8, "zero": "stage1"},
     "tokens_per_s_per_gpu": 326},
]
NOT_PRESET = ["26.06 Qwen3_30B_a3B, 16 GPUs, EP16: 8,826 tok/s/GPU", "26.06 Nemotron_3_Nano, 16 GPUs, EP8: 14,719"]
SCALE_MODELS = ["llama3_8b", "llama3_70b", "llama3_405b", "mixtral_8x7b"]
SCALE_GPUS = [8, 64, 512, 4096, 16384]


def scale_overrides(model: str, gpus: int, gbs: int, seq: int = 8192) -> list[str]:
    return ["tracking=off", f"model={model}", "cluster=dgx_h100", f"cluster.nodes={gpus // 8}",
            "precision=fp8_tensorwise", f"train.global_batch_size={gbs}", f"train.seq_length={seq}",
            "train.micro_batch_size=1", f"model.max_position_embeddings={max(seq, 8192)}"]


def published_rows() -> list[str]:
    """Each published row: predicted at its own layout against its tokens/s/GPU, and the
    advisor's own best layout for the same model, GPUs and batch."""
    from gridwright.validation.layout_advice import rank_layouts

    calibration = load_calibration()
    lines = ["| release | model | GPUs | published layout | published tok/s/GPU | predicted at it | error | "
             "advisor's best (predicted tok/s/GPU) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in PUBLISHED:
        overrides = scale_overrides(row["model"], row["gpus"], row["gbs"], row["seq"])
        cfg = compose_config(overrides + [f"{k}={'null' if v is None else v}" for k, v in row["layout"].items()]
                             + ["parallel.sp=true" if row["layout"]["parallel.tp"] > 1 else "parallel.sp=false",
                                "engine.overlap_grad_reduce=true", "engine.compile_layers=true",
                                f"engine.tp_comm_overlap={str(row['layout']['parallel.tp'] > 1).lower()}"])
        layout = layout_of(cfg)
        p = predict_step(cfg, layout, speeds_for(cfg.cluster.gpu.name, calibration))
        best = rank_layouts(compose_config(overrides), top=1)["candidates"]
        mine = f"{best[0].layout.slug()} mb{best[0].overrides['train.micro_batch_size']} " \
               f"recompute={best[0].overrides['train.recompute']} ({best[0].prediction.tokens_per_s_per_gpu:,.0f})" \
            if best else "no layout fits"
        uneven = cfg.model.num_layers % (layout.pp * (layout.vpp or 1))
        lines.append(f"| {row['release']} | {row['model']} | {row['gpus']} | {layout.slug()}"
                     f"{' (uneven stages¹)' if uneven else ''} | "
                     f"{row['tokens_per_s_per_gpu']:,} | {p.tokens_per_s_per_gpu:,.0f} | "
                     f"{_pct(p.tokens_per_s_per_gpu / row['tokens_per_s_per_gpu'] - 1)} | {mine} |")
    lines += ["", "¹ PP x VPP does not divide the model's layers: Megatron-Bridge gives the first and last stages "
              "fewer layers, which gridwright does not offer; predicted with fractional stages.",
              "", "Not predicted (no gridwright model preset): " + "; ".join(NOT_PRESET) + "."]
    return lines


def scale_rows() -> list[str]:
    """The advisor's best layout per model and GPU count on DGX-H100 nodes (FP8 current
    scaling, sequence 8192, global batch max(128, GPUs / 8) sequences)."""
    from gridwright.validation.layout_advice import rank_layouts

    lines = ["| model | GPUs | global batch | best layout | predicted tok/s/GPU | MFU (FP8 peak) | GiB | valid layouts "
             "/ fitting configurations² | search s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model in SCALE_MODELS:
        for gpus in SCALE_GPUS:
            gbs = max(128, gpus // 8)
            advice = rank_layouts(compose_config(scale_overrides(model, gpus, gbs)), top=1)
            n, best = advice["counted"], advice["candidates"]
            if not best:
                lines.append(f"| {model} | {gpus:,} | {gbs} | none fits | | | | {n['valid']} / 0 | "
                             f"{advice['seconds']:.1f} |")
                continue
            c = best[0]
            lines.append(f"| {model} | {gpus:,} | {gbs} | {c.layout.slug()} mb{c.overrides['train.micro_batch_size']} "
                         f"recompute={c.overrides['train.recompute']} | {c.prediction.tokens_per_s_per_gpu:,.0f} | "
                         f"{c.prediction.mfu * 100:.1f} % | {c.memory_gib:.0f} | {n['valid']} / {n['fit']} | "
                         f"{advice['seconds']:.1f} |")
    return lines + ["", "² A valid layout (degrees and micro-batch) is tried with ZeRO 0 and 1 (where DP x CP > 1), "
                    "three recompute choices and compiled layers or eager; the configurations that fit the card's "
                    "memory are ranked."]


def verified_rows() -> list[str]:
    """`launcher.verify` runs recorded on a GPU (tests/data/advice/*.json, each an advise.json
    as the advisor wrote it): predicted beside measured, and whether the measured order is
    the predicted one. Not fitted on."""
    from gridwright.validation.layout_advice import measured_in_predicted_order

    lines = []
    for path in sorted(ADVICE.glob("*.json")):
        record = json.loads(path.read_text())
        top = {t["rank"]: t for t in record["top"]}
        lines += [f"`{path.relative_to(REPO)}`: {record['model']} on {record['gpus']} x {record['card']}, global batch "
                  f"{record['global_batch_size']} x {record['seq_length']}, precisions offered "
                  f"{', '.join(record.get('precisions') or [record['precision']])}", "",
                  "| # | layout | predicted tok/s/GPU | measured | error | status |", "| --- | --- | --- | --- | --- | --- |"]
        for v in record["verified"]:
            o = top[v["rank"]]["overrides"]
            words = (f"{v['layout']} mb{o['train.micro_batch_size']} recompute={o['train.recompute']} "
                     f"{o.get('precision', record['precision'])} "
                     f"{'compiled' if o.get('engine.compile_layers') else 'eager'}")
            measured = v.get("measured_tokens_per_s_per_gpu")
            error = f"{v['predicted_tokens_per_s_per_gpu'] / measured - 1:+.1%}" if measured else ""
            lines.append(f"| {v['rank']} | {words} | {v['predicted_tokens_per_s_per_gpu']:,.0f} | "
                         f"{measured or 0:,.0f} | {error} | {v['status']} |")
        ran = sum(bool(v.get("measured_tokens_per_s_per_gpu")) for v in record["verified"])
        same = measured_in_predicted_order(record["verified"])
        order = {True: "the predicted one", False: "not the predicted one", None: "not known"}[same]
        lines += ["", f"Measured order: {order} ({ran} of {len(record['verified'])} runs measured).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the calibration from the CALIBRATION rows first")
    ap.add_argument("--published", action="store_true",
                    help="also Megatron-Bridge's published DGX-H100 rows, predicted at their layouts")
    ap.add_argument("--scale", action="store_true",
                    help="also the advisor's best layout per model and GPU count (8 to 16,384) on DGX-H100")
    ap.add_argument("--out", type=Path, help="also write the tables into OUT/validate_advisor_cpu.md "
                    "(evaluations/results: the current file)")
    args = ap.parse_args(argv)
    if args.fit:
        CALIBRATION_FILE.write_text(json.dumps(fit(), indent=1) + "\n")
        print(f"wrote {CALIBRATION_FILE}")
    calibration = load_calibration()
    text = ["Calibration (gridwright/planning/step_time_calibration.json):", ""]
    for speeds in calibration:
        text.append(f"- {speeds.card}: GEMMs " + ", ".join(f"{k} {v:.0f}" for k, v in speeds.matmul_tflops.items())
                    + f" TFLOP/s; attention {speeds.attention_tflops:.0f} TFLOP/s; the rest "
                    + ", ".join(f"{k} {v * 1e12:.0f}" for k, v in speeds.other_s_per_unit.items())
                    + f" ps per token x hidden x layer; CP ring hidden {speeds.cp_ring_hidden:.0%}; " + "; ".join(speeds.notes))
    text += ["", "Fitted from (nothing else): " + "; ".join(calibration[0].fitted_from) + ".", "",
             "The test set: every other committed GPU row of the Megatron engine on the torch-native spec.", ""]
    rows, skipped = test_rows()
    text.append(report(predicted_rows(rows, calibration), skipped))
    if args.published:
        text += ["", "## Megatron-Bridge's DGX-H100 rows", ""] + published_rows()
    if args.scale:
        text += ["", "## The advisor's best layouts on DGX-H100", ""] + scale_rows()
    if ADVICE.is_dir() and any(ADVICE.glob("*.json")):
        text += ["", "## `launcher.verify` on a GPU", ""] + verified_rows()
    print("\n".join(text))
    if args.out:
        from gridwright.evaluations.results_file import write_markdown

        command = "python -m gridwright.evaluations.validate_advisor " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])
        path = write_markdown(args.out, "validate_advisor", "cpu", command, "\n".join(text),
                              title="The step-time model against measured rows")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
