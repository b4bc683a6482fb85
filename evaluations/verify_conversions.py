"""Measured logit agreement of converted checkpoints, every architecture at several layouts.

    python -m gridwright.evaluations.verify_conversions [--no-save]

For each tiny random model (gridwright.adapters.tiny_models): convert Hugging Face ->
Megatron-Core, compare logits (transformers in fp32 on CPU against Megatron-Core in
TP x PP x EP gloo processes) at each layout, and check that converting back gives the
same bits. Prints a table and writes evaluations/results/verify_conversions_cpu.{md,json}.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from gridwright.adapters.convert import hf_to_megatron, megatron_to_hf
from gridwright.adapters.hf_files import SafetensorsSource
from gridwright.adapters.tiny_models import ARCHITECTURES, has_experts, make_tiny_model
from gridwright.adapters.verify_logits import compare_logits
from gridwright.evaluations.results_file import write_json, write_markdown

# (TP, PP, VPP, EP): every model at these; EP only where there are experts.
LAYOUTS = [(1, 1, None, 1), (2, 1, None, 1), (1, 2, None, 1), (1, 2, 2, 1), (2, 2, None, 1)]
MOE_LAYOUTS = [(1, 1, None, 2), (2, 1, None, 2), (1, 2, None, 2)]
RESULTS = Path(__file__).resolve().parent / "results"


def bit_exact(a: Path, b: Path) -> bool:
    sa, sb = SafetensorsSource(a), SafetensorsSource(b)
    return sa.names() == sb.names() and all(torch.equal(sa.get(n), sb.get(n)) for n in sa.names())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gridwright-verify-") as tmp:
        tmp = Path(tmp)
        for kind in ARCHITECTURES:
            hf = make_tiny_model(kind, tmp / kind)
            meg, back = tmp / f"{kind}_megatron", tmp / f"{kind}_back"
            hf_to_megatron(hf, meg)
            megatron_to_hf(meg, back)
            exact = bit_exact(hf, back)
            layouts = LAYOUTS + (MOE_LAYOUTS if has_experts(kind) else [])
            for tp, pp, vpp, ep in layouts:
                t0 = time.perf_counter()
                r = compare_logits(hf, meg, tp=tp, pp=pp, vpp=vpp, ep=ep)
                rows.append({"model": kind, "tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "processes": tp * pp * ep,
                             "round_trip_bit_exact": exact, "seconds": time.perf_counter() - t0, **r})
                print(f"{kind:<12} TP={tp} PP={pp} VPP={vpp or '-'} EP={ep}: max |diff| {r['max_abs_diff']:.2e}  "
                      f"mean {r['mean_abs_diff']:.2e}  max |logit| {r['max_abs_logit']:.2f}  bit-exact {exact}",
                      flush=True)
    header = ("| model | TP | PP | VPP | EP | processes | max abs diff | mean abs diff | max abs logit | "
              "round trip bit-exact |\n|---|---|---|---|---|---|---|---|---|---|")
    table = "\n".join([header] + [
        f"| {r['model']} | {r['tp']} | {r['pp']} | {r['vpp'] or '-'} | {r['ep']} | {r['processes']} | "
        f"{r['max_abs_diff']:.2e} | {r['mean_abs_diff']:.2e} | {r['max_abs_logit']:.2f} | {r['round_trip_bit_exact']} |"
        for r in rows
    ])
    worst = max(r["max_abs_diff"] for r in rows)
    print(f"\nworst max |diff| {worst:.2e} (gate: 1e-4); all round trips bit-exact: "
          f"{all(r['round_trip_bit_exact'] for r in rows)}")
    if not args.no_save:
        write_markdown(
            RESULTS, "verify_conversions", "cpu", "python -m gridwright.evaluations.verify_conversions",
            "CPU, fp32, gloo; tokens: batch 2 x sequence 16 x TP (random, seed 0). Tiny random models from "
            "`gridwright.adapters.tiny_models` (hidden 64, 4 layers, 4 heads, vocab 128; weights N(0, 0.08)). "
            "SP is on wherever TP > 1.\n\n" + table + f"\n\nWorst max |diff|: {worst:.2e} (gate 1e-4).",
            title="Logits of converted checkpoints: Hugging Face vs Megatron-Core")
        write_json(RESULTS, "verify_conversions", "cpu", rows)


if __name__ == "__main__":
    main()
