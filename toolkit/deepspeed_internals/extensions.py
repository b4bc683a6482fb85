"""Which of DeepSpeed's C++ ops a run will compile on first use.

An install without prebuilt ops (DS_BUILD_OPS=0) compiles an op just in time, through
torch's `cpp_extension.load` under the op's name: minutes on a small machine, once;
torch caches the library afterwards. The run announces it rather than stall silently.
Three internals tell: the op builders' names, DeepSpeed's record of the ops built into
the install (`installed_ops`, read without importing DeepSpeed), and torch's private
rule for where a JIT extension is cached (used rather than re-derived: it depends on
the Python and CUDA build).
"""
from __future__ import annotations

import os

SHM_COMM = "deepspeed_shm_comm"  # gloo all-reduce through shared memory: every CPU run
CPU_ADAM = "cpu_adam"  # the optimizer of ZeRO-Offload

# Compiler CPU seconds of each op, measured (user time of `builder.load()` into an empty
# TORCH_EXTENSIONS_DIR, 2-core CPU machine, gcc, 2026-11-28): the estimate a run announces.
# Its wall time is about the same on an idle machine (the op's two sources compile one after
# the other) and longer on a busy one.
COMPILE_CPU_S = {SHM_COMM: 75, CPU_ADAM: 135}

CITED = [
    ("deepspeed/ops/op_builder/cpu/comm.py", 'NAME = "deepspeed_shm_comm"'),
    ("deepspeed/ops/op_builder/cpu/cpu_adam.py", 'NAME = "cpu_adam"'),
    ("deepspeed/git_version_info.py", "installed_ops = dict.fromkeys(ALL_OPS.keys(), False)"),
    ("deepspeed/ops/op_builder/builder.py", "op_module = load(name=self.name,"),
    ("torch/utils/cpp_extension.py", "def _get_build_directory(name: str, verbose: bool) -> str:"),
    ("torch/utils/cpp_extension.py", 'filepath = os.path.join(path, f"{module_name}{LIB_EXT}")'),
]


def not_yet_built(names: list[str]) -> list[str]:
    """Those of the ops `names` that are neither built into the install nor cached by
    torch: the ones the run will compile."""
    from torch.utils.cpp_extension import _get_build_directory

    from ..versions.deepspeed_version import installed_build_info

    installed_ops = (installed_build_info() or {}).get("installed_ops", {})
    out = []
    for name in names:
        if installed_ops.get(name):  # DS_BUILD_CPU_ADAM=1 ... at install: never compiled at run time
            continue
        try:
            built = os.path.exists(os.path.join(_get_build_directory(name, False), f"{name}.so"))
        except Exception:  # noqa: BLE001 - unknown: announce rather than stay silent
            built = False
        if not built:
            out.append(name)
    return out


def compile_estimate_s(names: list[str], cores: int = 1, busy: float = 0.0) -> float:
    """Seconds the ops `names` take to compile: their measured compiler time (an op not
    measured counts as the slowest measured one), stretched when the compiler shares the
    machine's `cores` with `busy` other runnable processes (the load average)."""
    cpu_s = sum(COMPILE_CPU_S.get(name, max(COMPILE_CPU_S.values())) for name in names)
    return cpu_s * max(1.0, (1.0 + busy) / cores)
