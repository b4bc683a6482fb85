"""Which Megatron-Core gridwright is tested with, and what to do about another one.

gridwright patches Megatron-Core functions, calls private ones and writes its checkpoint
format by hand (all in `gridwright.megatron_internals`). Each of those is true of one
release. GPU installs use `pip install --no-deps`, so nothing else stops an upgraded
Megatron-Core from failing somewhere deep, or worse, half-working. This module only
reads the version, so validation can refuse before start without importing the engine.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

from .version_fence import VersionFence

TESTED = "0.16.1"
OVERRIDE = "GRIDWRIGHT_UNTESTED_MEGATRON_CORE"  # =1: try another version anyway, loudly


class UntestedMegatronCore(RuntimeError):
    """The installed Megatron-Core is not the tested release."""


def installed_version() -> str | None:
    """`megatron.core.__version__`, or None without Megatron-Core. When megatron.core is
    not imported yet, its package_info.py (plain constants) is read on its own: importing
    megatron.core loads most of the library, seconds that validation need not spend."""
    if "megatron.core" in sys.modules:
        return getattr(sys.modules["megatron.core"], "__version__", None)
    spec = importlib.util.find_spec("megatron")
    for root in (spec.submodule_search_locations or []) if spec else []:
        info = Path(root) / "core" / "package_info.py"
        if info.is_file():
            return runpy.run_path(str(info))["__version__"]
    return None


FENCE = VersionFence("Megatron-Core", "megatron-core", TESTED, OVERRIDE, "its patches and checkpoint format",
                     "gridwright.megatron_internals", lambda: installed_version(), UntestedMegatronCore)
version_problem = FENCE.version_problem
refusal = FENCE.refusal
refuse_untested = FENCE.refuse_untested
