"""The one door to Megatron-Core internals: every patch, private call and format constant
gridwright depends on, behind a version check.

Importing this package (or any module in it) refuses a Megatron-Core other than the
tested release (`gridwright.versions.megatron_version`), unless GRIDWRIGHT_UNTESTED_MEGATRON_CORE=1
lets a user try anyway, with a warning. Modules:

    fixes              Megatron-Core bugs without Transformer Engine or Apex (GPU too)
    cpu_compat         what a CPU run needs (CUDA hard-coded where no flag reaches)
    checkpoint_format  the torch_dist metadata gridwright writes, and private calls of
                       the checkpoint and optimizer code
    parallel_linear    column/row-parallel linears with async TP (symmetric memory) and
                       torchao float8 matmuls, through Megatron-Core's private hook
    wgrad_accumulation the fused GEMM Megatron-Core's gradient-accumulation fusion calls
                       (Apex's extension), supplied by torch

Each patch names the upstream line it stands for (or relies on) in its module's `CITED` list; the
tests check that every cited line is still in the installed Megatron-Core, so an
upgrade that fixes one fails the test and the patch can go. Public Megatron-Core API
(GPTModel, parallel_state, the schedules) is used directly by the engines.
"""
from ..versions.megatron_version import refuse_untested

refuse_untested()
