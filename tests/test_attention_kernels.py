"""The attention kernel chosen by measurement (gridwright.engines.attention_kernels), on
the CPU's two SDPA backends (flash and math): times, errors against fp32, the refusal of a
backend that cannot take the call, the priority a run holds, and two ranks agreeing."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

from gridwright.config.compose import compose_config
from gridwright.engines import attention_kernels as ak
from gridwright.planning.layout import ParallelLayout
from gridwright.runtime.loopback import free_port

SHAPE = ak.AttentionShape(batch=2, heads=4, groups=2, queries=128, keys=128, dim=32)
CP_CHUNK = ak.AttentionShape(batch=1, heads=4, groups=1, queries=32, keys=128, dim=32)


def test_measure_times_and_checks_each_backend():
    for shape in (SHAPE, CP_CHUNK):
        choice = ak.measure(shape, torch.float32, "cpu", ["flash", "math", "efficient"], repeats=2)
        assert set(choice.ms) == {"flash", "math"} and all(ms > 0 for ms in choice.ms.values())
        assert choice.backend == min(choice.ms, key=choice.ms.get)
        assert choice.error["math"] == 0.0  # math in fp32 is the reference itself
        assert 0 < choice.error["flash"] < 1e-5  # another kernel: rounding, nothing more
        # the memory-efficient kernel is CUDA's: refused with torch's reason, not run
        assert "efficient" not in choice.ms and "No viable backend" in choice.refused["efficient"]


def test_bf16_errors_are_bf16_sized():
    choice = ak.measure(SHAPE, torch.bfloat16, "cpu", ["flash", "math"], repeats=1)
    assert all(1e-4 < e < ak.TOLERANCE[torch.bfloat16] for e in choice.error.values()), choice.error


def test_use_puts_the_choice_first():
    before = _cur_sdpa_kernel_backends(with_priority=True)
    with ak.use(ak.AttentionChoice("math", "setting")):
        order = _cur_sdpa_kernel_backends(with_priority=True)
        assert order[0] == SDPBackend.MATH and SDPBackend.FLASH_ATTENTION in order
    assert _cur_sdpa_kernel_backends(with_priority=True) == before
    with ak.use(ak.AttentionChoice("default", "CPU")):  # nothing changes
        assert _cur_sdpa_kernel_backends(with_priority=True) == before


def test_auto_on_cpu_does_not_measure_and_shape_follows_layout():
    cfg = compose_config(["+experiment=tiny_llama_tp2", "parallel.cp=2", "parallel.tp=1", "cluster.gpus_per_node=2"])
    shape = ak.attention_shape(cfg.model, cfg.train, ParallelLayout.from_config(cfg))
    assert (shape.queries, shape.keys) == (cfg.train.seq_length // 4, cfg.train.seq_length)  # CP's last chunk
    whole = ak.attention_shape(cfg.model, cfg.train, ParallelLayout.from_config(cfg), "a2a")  # half the heads
    assert (whole.heads, whole.groups, whole.queries, whole.lower_right) == (2, 1, cfg.train.seq_length, False)
    choice = ak.choose("auto", shape, torch.float32, "cpu")
    assert choice.backend == "default" and not choice.ms
    assert ak.choose("math", shape, torch.float32, "cpu").backend == "math"
    line = ak.summary_line(ak.measure(SHAPE, torch.float32, "cpu", ["flash", "math"], repeats=1).facts())
    assert "forward + backward per call: " in line and " ms" in line


def _agree_worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # rank 0 finds flash faster, rank 1 math, and only rank 1 could run cuDNN
    times = [{"flash": 1.0, "math": 5.0}, {"flash": 9.0, "math": 6.0, "cudnn": 0.5}][rank]
    agreed = ak._agree(ak.AttentionChoice("x", "measurement", ms=times, error={n: 0.0 for n in times}))
    out[rank] = (agreed.backend, agreed.ms, dict(agreed.refused))
    dist.destroy_process_group()


def test_ranks_agree_on_the_slowest_ranks_times():
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(_agree_worker, args=(port, out), nprocs=2)
    assert out[0][:2] == out[1][:2] == ("math", {"flash": 9.0, "math": 6.0})
    assert out[0][2] == {} and out[1][2] == {"cudnn": "refused on another rank"}


def test_lower_right_choices_leave_one_fused_kernel_on():
    """CP's lower-right masks are dispatched by torch among the fused kernels that are on,
    whatever the priority: the chosen one is the only one left (math stays as the last
    resort), so the summary names what runs."""
    with ak.use(ak.AttentionChoice("efficient", "measurement", only=True)):
        assert _cur_sdpa_kernel_backends(with_priority=True)[:2] == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    cfg = compose_config(["+experiment=tiny_llama_tp2", "parallel.cp=2", "parallel.tp=1", "cluster.gpus_per_node=2"])
    shape = ak.attention_shape(cfg.model, cfg.train, ParallelLayout.from_config(cfg))
    assert ak.choose("flash", shape, torch.float32, "cpu").only  # a named kernel under CP: alone too


def test_exactness_check_is_bounded_in_heads_and_length():
    big = ak.AttentionShape(batch=4, heads=64, groups=8, queries=131072, keys=131072, dim=128)
    check = ak._check_shape(big)
    assert (check.batch, check.heads, check.groups, check.queries, check.keys) == (1, 4, 1, 4096, 4096)
    chunk = ak._check_shape(ak.AttentionShape(batch=1, heads=8, groups=8, queries=8192, keys=65536, dim=64))
    assert check.lower_right is False and chunk.lower_right and (chunk.heads, chunk.groups) == (4, 4)


def test_a_restart_keeps_the_first_attempts_choice(tmp_path):
    assert ak.remembered(tmp_path) is None and ak.remembered(None) is None
    first = ak.AttentionChoice("efficient", "measurement", "shape", {"flash": 2.0, "efficient": 1.0},
                               {"flash": 1e-3, "efficient": 2e-3}, {"cudnn": "x"}, only=True)
    ak.remember(first, tmp_path)
    again = ak.remembered(tmp_path)
    assert (again.backend, again.ms, again.error, again.refused, again.only) == (
        "efficient", first.ms, first.error, first.refused, True)
    assert again.chosen_by == "measurement, kept from the job's first attempt"
