"""Which Megatron-Core gridwright is tested with, and what to do about another one.

gridwright patches Megatron-Core functions, calls private ones and writes its checkpoint
format by hand (all in `gridwright.megatron_internals`). Each of those is true of one
release. GPU installs use `pip install --no-deps`, so nothing else stops an upgraded
Megatron-Core from failing somewhere deep, or worse, half-working. This module only
reads the version, so validation can refuse before start without importing the engine.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path

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


def version_problem(version: str | None = None) -> str | None:
    """One line naming the problem with `version` (default: the installed one), or None."""
    version = installed_version() if version is None else version
    if version == TESTED:
        return None
    found = "is not installed" if version is None else f"{version} is installed"
    return (f"Megatron-Core {found}; gridwright is tested with megatron-core=={TESTED} only (its patches and "
            f"checkpoint format are that release's). Fix: pip install megatron-core=={TESTED}, or set "
            f"{OVERRIDE}=1 to try anyway.")


def _overridden() -> bool:
    return os.environ.get(OVERRIDE) == "1"


def refusal(version: str | None = None) -> str | None:
    """The problem with `version` that stops gridwright, or None: an untested version does
    not stop it while the override is set (refuse_untested then warns)."""
    problem = version_problem(version)
    return None if _overridden() else problem


def refuse_untested(version: str | None = None) -> None:
    """Raise UntestedMegatronCore for an untested version, unless the override is set:
    then warn on stderr, once per process, and go on."""
    problem = version_problem(version)
    if problem is None:
        return
    if not _overridden():
        raise UntestedMegatronCore(problem)
    print(f"WARNING: {OVERRIDE}=1: {problem.split(';')[0]}, untested; patches in gridwright.megatron_internals "
          "may no longer fit it. Compare a run against one on the tested release before trusting it.",
          file=sys.stderr, flush=True)
