"""Which DeepSpeed gridwright is tested with, and what to do about another one.

gridwright repairs a DeepSpeed defect, reads engine attributes outside its documented
API, imports its non-public modules and relies on its checkpoint files' layout (all in
`gridwright.deepspeed_internals`). Each of those is true of one release; an upgraded
DeepSpeed could fail somewhere deep, or worse, half-work (a repair that no longer fits
silently trains with the wrong settings). This module only reads the version, without
importing DeepSpeed (seconds, and it prints), so validation can refuse before start.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import runpy
import sys
from pathlib import Path

from .version_fence import VersionFence

TESTED = "0.19.8"
OVERRIDE = "GRIDWRIGHT_UNTESTED_DEEPSPEED"  # =1: try another version anyway, loudly

# What installed_build_info reads: setup.py writes this file of plain constants into an
# installed DeepSpeed, and `deepspeed.__version__` comes from it.
CITED = [
    ("deepspeed/git_version_info.py", "from .git_version_info_installed import *  # noqa: F401 # type: ignore"),
    ("deepspeed/__init__.py", "from .git_version_info import version, git_hash, git_branch"),
    ("deepspeed/__init__.py", "__version__ = version"),
]


class UntestedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is not the tested release."""


def installed_build_info() -> dict | None:
    """The constants of the DeepSpeed package that `import deepspeed` would load
    (`version`, `installed_ops`, ...), from its git_version_info_installed.py; None without
    DeepSpeed, or for a source checkout that has no such file."""
    spec = importlib.util.find_spec("deepspeed")
    for root in (spec.submodule_search_locations or []) if spec else []:
        info = Path(root) / "git_version_info_installed.py"
        if info.is_file():
            return runpy.run_path(str(info))
    return None


def installed_version() -> str | None:
    """`deepspeed.__version__`, or None without DeepSpeed. Read from the imported module
    when there is one, else from the package's version file, else the distribution's."""
    if "deepspeed" in sys.modules:
        return getattr(sys.modules["deepspeed"], "__version__", None)
    info = installed_build_info()
    if info is not None:
        return info.get("version")
    if importlib.util.find_spec("deepspeed") is None:
        return None
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


FENCE = VersionFence("DeepSpeed", "deepspeed", TESTED, OVERRIDE, "its repairs, private calls and checkpoint handling",
                     "gridwright.deepspeed_internals", lambda: installed_version(), UntestedDeepSpeed)
version_problem = FENCE.version_problem
refusal = FENCE.refusal
refuse_untested = FENCE.refuse_untested
