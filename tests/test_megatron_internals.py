"""The one door to Megatron-Core internals: its version fence, and each patch still needed."""
import os
import subprocess
import sys
from pathlib import Path

import megatron.core
import pytest
import torch

from gridwright.megatron_internals import checkpoint_format, cpu_compat, fixes, parallel_linear, wgrad_accumulation
from gridwright.versions.megatron_version import OVERRIDE, TESTED, UntestedMegatronCore, refuse_untested, version_problem

MCORE = Path(megatron.core.__file__).parent
MODULES = (fixes, cpu_compat, checkpoint_format, parallel_linear, wgrad_accumulation)
CITED = [(m.__name__.rsplit(".", 1)[1], path, text) for m in MODULES for path, text in m.CITED]


@pytest.mark.parametrize("module,path,text", CITED)
def test_each_patch_is_still_needed(module, path, text):
    """Every upstream line a patch stands for is still in the installed Megatron-Core: if
    an upgrade removes one, this fails and the patch can go."""
    assert text in (MCORE / path).read_text(), f"{path} no longer contains {text!r}: drop the patch in {module}"


@pytest.mark.slow
def test_the_router_gemm_is_unbound_without_the_fix():
    """fixes._bind_te_general_gemm: without TE, moe_utils never binds te_general_gemm."""
    code = "from megatron.core.transformer.moe import moe_utils; print(hasattr(moe_utils, 'te_general_gemm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


FAKED = ("import megatron.core; megatron.core.__version__ = '0.17.0'; "
         "import gridwright.megatron_internals; print('imported')")


@pytest.mark.slow
def test_an_untested_megatron_core_is_refused_at_import():
    env = {k: v for k, v in os.environ.items() if k != OVERRIDE}
    r = subprocess.run([sys.executable, "-c", FAKED], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "imported" not in r.stdout
    assert f"Megatron-Core 0.17.0 is installed; gridwright is tested with megatron-core=={TESTED}" in r.stderr
    r = subprocess.run([sys.executable, "-c", FAKED], capture_output=True, text=True, env=dict(env, **{OVERRIDE: "1"}))
    assert r.returncode == 0 and r.stdout.strip() == "imported"
    assert "WARNING" in r.stderr and "0.17.0" in r.stderr and "untested" in r.stderr


@pytest.mark.slow
def test_a_local_launch_and_the_converter_refuse_an_untested_megatron_core_before_start(tmp_path):
    """Each says it in one line with exit 2, and creates nothing."""
    code = ("import sys, megatron.core; megatron.core.__version__ = '0.15.0'\n"
            "from gridwright.adapters.convert import main as convert\n"
            f"print('convert', convert(['hf-to-megatron', '--hf', '{tmp_path}', '--out', '{tmp_path / 'out'}']))\n"
            "from gridwright.cli import main\n"
            f"sys.argv = ['launch.py', 'tracking=off', 'job_dir={tmp_path / 'job'}']; main()")
    env = {k: v for k, v in os.environ.items() if k != OVERRIDE}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 2 and "convert 2" in r.stdout, r.stderr[-2000:]
    assert r.stderr.count("Megatron-Core 0.15.0 is installed") == 2
    assert not (tmp_path / "job").exists() and not (tmp_path / "out").exists()
    assert version_problem(TESTED) is None
    with pytest.raises(UntestedMegatronCore, match="0.15.0 is installed"):
        refuse_untested("0.15.0")


def test_a_worker_refuses_fp8_without_transformer_engine(compose):
    """Every launcher's worker repeats the FP8 check (only a local launch validates this
    machine before start): a Slurm worker must not train in bf16 under an FP8 config that
    neither Transformer Engine nor torchao can run here."""
    from gridwright.runtime.machine_probe import transformer_engine_available
    from gridwright.launchers.worker import refuse_what_this_machine_cannot_run

    if transformer_engine_available():
        pytest.skip("Transformer Engine imports here")
    for refused in (["precision=fp8_delayed"],  # a recipe torchao does not offer
                    ["precision=fp8_tensorwise", "precision.fp8_backend=transformer_engine"]):
        cfg = compose("cluster=h100_x1", "launcher=slurm", *refused)
        with pytest.raises(RuntimeError, match="FP8 needs Transformer Engine"):
            refuse_what_this_machine_cannot_run(cfg)
    # tensorwise falls back to torchao (installed with gridwright); bf16 needs nothing
    refuse_what_this_machine_cannot_run(compose("cluster=h100_x1", "precision=fp8_tensorwise", "launcher=slurm"))
    refuse_what_this_machine_cannot_run(compose("cluster=h100_x1", "precision=bf16", "launcher=slurm"))


def test_cuda_requests_land_on_cpu_inside_and_fail_outside():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    with cpu_compat.cpu_compat():
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert t.float().type() == "torch.cuda.FloatTensor"
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
    assert torch.zeros(1).type() == "torch.FloatTensor"  # restored on exit
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_compat_module_stays_small():
    code = [line for line in Path(cpu_compat.__file__).read_text().splitlines() if line.strip()]
    assert len(code) < 165
