"""The weight-gradient GEMM alone, fused against unfused, on one GPU.

    python -m gridwright.evaluations.bench_wgrad_gemm [--tokens 8192] [--out DIR]

For each weight shape of the Llama-3-8B layer and its output layer, dW = dy.T @ x is added
into an fp32 buffer (the buffer Megatron-Core's DDP keeps for the weight) two ways:
unfused, the GEMM writes a bf16 product and a second kernel adds it; fused, the GEMM adds
into the buffer itself (`engine.gradient_accumulation_fusion`). Both in bf16
(`torch.addmm(..., out_dtype=float32)`) and in float8 (torchao's tensorwise scaling:
dy in e5m2, x in e4m3; unfused `torch._scaled_mm`, fused cuBLASLt through
`gridwright.torch_internals.float8_gemm`). The table gives each form's time and the relative error
of the added product against the same product in fp32 arithmetic (for float8, of the
dequantized float8 operands: the error of the GEMM, not of the quantization).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# [out, in] of the Llama-3-8B linears (q, k and v fused; gate and up fused) and its output layer
SHAPES = {"qkv": (6144, 4096), "proj": (4096, 4096), "fc1": (28672, 4096), "fc2": (4096, 14336),
          "output": (128256, 4096)}


def _milliseconds(fn, repeats: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _relative_error(got, exact, start) -> float:
    return ((got - exact).norm() / (exact - start).norm()).item()


def measure(name: str, out_features: int, in_features: int, tokens: int) -> dict:
    import torch

    from gridwright.megatron_internals.wgrad_accumulation import accumulate_weight_gradient, to_float8
    from gridwright.torch_internals.float8_gemm import accumulate_float8_gemm

    torch.manual_seed(0)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    start = torch.randn(out_features, in_features, device="cuda")
    row = {"weight": f"{name} [{out_features}, {in_features}]"}

    exact = start + dy.float().t() @ x.float()
    fused = start.clone()
    accumulate_weight_gradient(x, dy, fused)
    row["bf16 error"] = (_relative_error(start + (dy.t() @ x).float(), exact, start), _relative_error(fused, exact, start))
    buffer = start.clone()
    row["bf16 ms"] = (_milliseconds(lambda: buffer.add_(dy.t() @ x)),
                      _milliseconds(lambda: accumulate_weight_gradient(x, dy, buffer)))

    (dy8, dy_scale), (x8, x_scale) = to_float8(dy, torch.float8_e5m2), to_float8(x, torch.float8_e4m3fn)
    dy_inverse, x_inverse = dy_scale.reciprocal(), x_scale.reciprocal()
    a, b = dy8.t().contiguous(), x8.t().contiguous()  # the token dimension contiguous in both

    def scaled_mm():
        return torch._scaled_mm(a, b.t(), scale_a=dy_inverse, scale_b=x_inverse, out_dtype=torch.bfloat16)

    exact = start + (a.float() * dy_inverse) @ (b.float() * x_inverse).t()
    fused = start.clone()
    accumulate_float8_gemm(a, dy_inverse, b, x_inverse, fused)
    row["float8 error"] = (_relative_error(start + scaled_mm().float(), exact, start), _relative_error(fused, exact, start))
    row["float8 ms"] = (_milliseconds(lambda: buffer.add_(scaled_mm())),
                        _milliseconds(lambda: accumulate_float8_gemm(a, dy_inverse, b, x_inverse, buffer)))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| weight [out, in] | bf16 unfused ms | bf16 fused ms | bf16 error unfused / fused "
             "| float8 unfused ms | float8 fused ms | float8 error unfused / fused |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['weight']} | {r['bf16 ms'][0]:.3f} | {r['bf16 ms'][1]:.3f} | "
                     f"{r['bf16 error'][0]:.2e} / {r['bf16 error'][1]:.2e} | {r['float8 ms'][0]:.3f} | "
                     f"{r['float8 ms'][1]:.3f} | {r['float8 error'][0]:.2e} / {r['float8 error'][1]:.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="the contraction dimension (micro-batch x sequence)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: bench_wgrad_gemm measures CUDA GEMMs; no GPU is visible", file=sys.stderr)
        sys.exit(2)
    from .results_file import card_of_this_machine, write_markdown

    rows = [measure(name, *shape, args.tokens) for name, shape in SHAPES.items()]
    card = torch.cuda.get_device_name(0)
    text = (f"GPU: {card}, torch {torch.__version__}; {args.tokens} tokens. Time per GEMM (and add), mean of 20 "
            "after 3 warm-ups; error: relative to fp32 arithmetic on the same operands.\n\n" + table(rows))
    path = write_markdown(args.out, "bench_wgrad_gemm", card_of_this_machine(), " ".join(["python -m",
                          "gridwright.evaluations.bench_wgrad_gemm"] + sys.argv[1:]), text)
    print(path.read_text())


if __name__ == "__main__":
    main()
