"""ZeRO-Offload on CPU against the Megatron engine: from the same weights (fp32, 2
processes, DP=2), optimizer offload under ZeRO-2 and optimizer + parameter offload under
ZeRO-3 follow the Megatron engine's loss step by step. Offload uses DeepSpeed's own CPU
Adam (`cpu_adam`, compiled on first use: about 1-3 minutes on 2 cores, once per machine)."""
import pytest
from test_deepspeed_runs import deepspeed_run_from_hf, megatron_run_from_hf

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    return megatron_run_from_hf(tmp_path_factory.mktemp("offload"), "llama")


@pytest.mark.parametrize("offload", [["zero=stage2", "zero.offload_optimizer=true"],
                                     ["zero=stage3", "zero.offload_optimizer=true", "zero.offload_params=true"]],
                         ids=["zero2_optimizer", "zero3_optimizer_and_params"])
def test_offloaded_runs_follow_the_megatron_engine(start, offload):
    want_loss, want_norm = start[3]
    loss, norm = deepspeed_run_from_hf(start, offload[0].split("=")[1], *offload, timeout=900)
    assert want_loss[-1] < want_loss[0] - 0.5
    assert loss == pytest.approx(want_loss, rel=1e-3)
    assert norm == pytest.approx(want_norm, rel=1e-3)
