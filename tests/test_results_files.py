"""evaluations/results holds one current file per benchmark and card, listed in its README;
a benchmark's new call replaces its file."""
from __future__ import annotations

import re

import pytest
from conftest import REPO

from gridwright.evaluations.bench_gpu import SUITES
from gridwright.evaluations.results_file import results_path, write_json, write_markdown

RESULTS = REPO / "evaluations" / "results"
# Each script's benchmark names (bench_gpu: one per suite).
BENCHMARKS = {
    *(f"bench_gpu_{suite}" for suite in SUITES),
    "bench_wgrad_gemm", "bench_convert", "bench_plan", "bench_dynamic_cp", "verify_conversions", "gpu_tier",
    "fp8_loss_check", "fp8_loss_check_te", "varlen_loss_check", "eval_sweep", "validate_traces_megatron",
    "validate_traces_deepspeed", "comm_profile",
    "stop_check", "bench_checkpoint", "validate_advisor",
}
NAME = re.compile(r"(?P<benchmark>[a-z0-9_]+?)_(?P<card>cpu|\d+x[a-z0-9]+)\.(?P<suffix>md|json)")


def test_one_current_file_per_benchmark_and_card():
    seen = {}
    for path in sorted(RESULTS.iterdir()):
        if path.name == "README.md":
            continue
        parsed = [m for m in (NAME.fullmatch(path.name),) if m and m["benchmark"] in BENCHMARKS]
        assert parsed, f"{path.name} is not <benchmark>_<card>.md|json of a known benchmark (a dated name?)"
        key = (parsed[0]["benchmark"], parsed[0]["card"], parsed[0]["suffix"])
        assert key not in seen, f"{path.name} and {seen[key]}: two files of one benchmark and card"
        seen[key] = path.name


def test_the_results_stay_a_page_of_current_files():
    """One current file per benchmark and card reads as one page: superseded calls and
    comparisons live in git history (the README says at which commit)."""
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= 26, f"{len(files)} files in evaluations/results (at most 26): {files}"


def test_the_results_readme_lists_exactly_the_files_present():
    listed = set(re.findall(r"^\| `([^`]+)` \|", (RESULTS / "README.md").read_text(), re.M))
    present = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert listed == present, f"unlisted: {sorted(present - listed)}; listed but absent: {sorted(listed - present)}"


# A number with a unit of speed, memory or share: a measurement (card names such as
# "1 × H200" are not).
MEASUREMENT = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:%|×(?!\s?[A-Z])|tok/s|tokens/s|GiB|GB/s|TFLOP|ms\b|s/step|MFU)")


def measurements(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MEASUREMENT.search(line)]


def test_the_readme_is_the_product_and_the_performance_page_one_table_per_card():
    """The README says what gridwright is and how to run it, in at most 150 lines and with no
    measured number; measurements live on docs/performance.md, kept to about a page."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, f"README.md has {len(readme.splitlines())} lines (at most 150)"
    assert not measurements(readme), f"measurements in README.md: {measurements(readme)}"
    assert "docs/performance.md" in readme
    performance = (REPO / "docs" / "performance.md").read_text()
    assert len(performance.splitlines()) <= 220, f"docs/performance.md: {len(performance.splitlines())} lines"


def test_the_measurement_search_finds_one():
    assert measurements("TE FP8 ran 1.32× bf16\n8B shape: 56.4 % MFU\n21,545 tok/s\non 1 × H200, 2 × H100")[:3] == [
        "TE FP8 ran 1.32× bf16", "8B shape: 56.4 % MFU", "21,545 tok/s"]
    assert not measurements("on 1 × H200 and 8 × H100; TP=2")


def test_a_new_call_replaces_the_file_of_its_benchmark_and_card(tmp_path):
    first = write_markdown(tmp_path, "bench_plan", "cpu", "python -m x --a", "| old |")
    second = write_markdown(tmp_path, "bench_plan", "cpu", "python -m x --b", "| new |", title="Plan commands")
    write_json(tmp_path, "bench_plan", "cpu", {"rows": [1]})
    assert first == second == tmp_path / "bench_plan_cpu.md"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_plan_cpu.json", "bench_plan_cpu.md"]
    text = second.read_text()
    assert text.startswith("# Plan commands: cpu, 20") and "Command: `python -m x --b`" in text
    assert "| new |" in text and "| old |" not in text


@pytest.mark.parametrize("card", ["", "h200", "1 x H200", "1xH200", "../x"])
def test_a_card_is_cpu_or_count_x_model(card, tmp_path):
    with pytest.raises(ValueError, match="is not 'cpu' or"):
        results_path(tmp_path, "bench_gpu_te", card)


def test_the_cublaslt_gemm_is_on_by_default_only_while_the_gpu_tier_passes_it(compose):
    """The float8 weight-gradient GEMM bound through ctypes (torch_internals.float8_gemm) runs by
    default on CUDA (engine.gradient_accumulation_fusion=null with torchao's tensorwise FP8).
    Its only check on a real cuBLASLt is the GPU tier: every tier file must record those
    tests as passed, or the default must be turned off."""
    from gridwright.engines.megatron_model import gradient_accumulation_fusion

    cfg = compose("model=llama3_8b", "cluster=h100_x1", "precision=fp8_tensorwise", "launcher=plan")
    tiers = sorted(RESULTS.glob("gpu_tier_*.md"))
    assert tiers, "no GPU tier results file"
    if not gradient_accumulation_fusion(cfg):
        return
    for tier in tiers:
        rows = re.findall(r"^\| `(test_wgrad_accumulation::test_the_cublaslt_gemm[^`]*)` \| (\w[\w ]*?) \|",
                          tier.read_text(), re.M)
        assert len(rows) >= 3, f"{tier.name} records {len(rows)} cuBLASLt GEMM tests"
        failed = [name for name, result in rows if result != "passed"]
        assert not failed, (f"{tier.name}: {failed} did not pass on the GPU, yet the cuBLASLt GEMM is on by default. "
                            "Fix: make engine.gradient_accumulation_fusion's CUDA default leave torchao's float8 "
                            "weight gradients to torch._scaled_mm until the tier passes.")
