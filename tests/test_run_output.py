"""What a run says on the terminal where the CPU runs cannot show it: a GPU run's MFU line
(with its definition), and the word before DeepSpeed's first JIT compile."""
from gridwright.launchers.worker import summary_lines


def test_gpu_summary_names_the_mfu_definition_and_the_peak(compose):
    cfg = compose("+bench=bench_gpu")
    summary = {"steps": 30, "steps_averaged": list(range(1, 30)), "first_loss": 10.78, "last_loss": 7.5,
               "mean_step_time_s": 1.01, "tokens_per_s_per_gpu": 64934.0, "tflops_per_gpu": 358.9,
               "flops_definition": "megatron", "mfu": 0.363, "mfu_palm": 0.416, "hfu": 0.363,
               "peak_tflops": 989.0, "peak_kind": "bf16", "memory_peak_gib": 27.8, "memory_peak_rank": 0,
               "memory_reserved_peak_gib": 30.1, "memory_estimate_allocated_gib": 27.7}
    text = "\n".join(summary_lines(summary, cfg.cluster))
    assert "summary     30 steps: loss 10.7800 -> 7.5000" in text
    assert "64,934 tokens/s/GPU, 1,010.0 ms/step, 358.9 TFLOP/s/GPU (mean of steps 1-29)" in text
    assert "MFU 36.3% (megatron definition, 41.6% by palm; HFU 36.3%) against 989 TFLOP/s bf16 (H100-SXM)" in text
    assert "peak memory 27.80 GiB allocated by the CUDA allocator, rank 0; estimate 27.7 GiB without workspace" in text
    summary.update(flops_definition="palm", mfu=0.416)
    assert "MFU 41.6% (palm definition; HFU 36.3%)" in "\n".join(summary_lines(summary, cfg.cluster))


def test_deepspeed_first_compile_is_announced(compose, tmp_path, monkeypatch):
    from gridwright.engines.deepspeed_engine import extensions_to_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here yet
    cfg, offload = compose("engine=deepspeed"), compose("engine=deepspeed", "zero=stage2_offload")
    assert extensions_to_build(cfg.cluster, cfg.zero) == ["deepspeed_shm_comm"]
    assert extensions_to_build(offload.cluster, offload.zero) == ["deepspeed_shm_comm", "cpu_adam"]
    built = tmp_path / "deepspeed_shm_comm"
    built.mkdir(exist_ok=True)  # torch creates the build directory when asked for it
    (built / "deepspeed_shm_comm.so").write_bytes(b"")
    assert extensions_to_build(cfg.cluster, cfg.zero) == []
