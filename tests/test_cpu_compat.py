"""The CPU compatibility layer: it works, and each workaround is still needed upstream."""
from pathlib import Path

import megatron.core
import pytest
import torch

from gridwright.engines.megatron_cpu_compat import cpu_compat

MCORE = Path(megatron.core.__file__).parent

# (file, text) pairs the module docstring cites: if an upgrade removes one, this fails
# and the workaround can go.
CITED = [
    ("pipeline_parallel/schedules.py", 'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("optimizer/optimizer.py", "self.found_inf = torch.tensor([0.0], dtype=torch.float, device='cuda')"),
    ("optimizer/clip_grads.py", "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    ("optimizer/distrib_optimizer.py", "elif model_param.type() == 'torch.cuda.FloatTensor':"),
    ("utils.py", "device=torch.cuda.current_device(),"),
    ("transformer/moe/router.py", "self.weight.data.to(device=torch.cuda.current_device())"),
    ("pipeline_parallel/p2p_communication.py", "torch.cuda.synchronize()"),
    ("distributed/distributed_data_parallel.py", "torch.cuda.Stream(device=torch.cuda.current_device())"),
    ("transformer/moe/moe_utils.py", "if te_general_gemm is not None"),
    ("models/common/embeddings/rope_utils.py", "pin_memory=True"),
    ("tensor_parallel/random.py", "return torch.cuda.random.get_rng_state(device=device)"),
    ("optimizer/distrib_optimizer.py", "dst_tensors = {\"param\": main_param, **optim_state}"),
    ("optimizer/distrib_optimizer.py", "                s[\"step\"] = step\n"),
]


@pytest.mark.parametrize("path,text", CITED)
def test_each_workaround_is_still_needed(path, text):
    assert text in (MCORE / path).read_text(), f"{path} no longer contains {text!r}: drop the workaround"


def test_cuda_requests_land_on_cpu_inside_and_fail_outside():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    with cpu_compat():
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert t.float().type() == "torch.cuda.FloatTensor"
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
    assert torch.zeros(1).type() == "torch.FloatTensor"  # restored on exit
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_compat_module_stays_small():
    from gridwright.engines import megatron_cpu_compat

    code = [l for l in Path(megatron_cpu_compat.__file__).read_text().splitlines() if l.strip()]
    assert len(code) < 150
