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
import os
import runpy
import sys
from pathlib import Path

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


def version_problem(version: str | None = None) -> str | None:
    """One line naming the problem with `version` (default: the installed one), or None."""
    version = installed_version() if version is None else version
    if version == TESTED:
        return None
    found = "is not installed" if version is None else f"{version} is installed"
    return (f"DeepSpeed {found}; gridwright is tested with deepspeed=={TESTED} only (its repairs, private calls "
            f"and checkpoint handling are that release's). Fix: pip install deepspeed=={TESTED}, or set "
            f"{OVERRIDE}=1 to try anyway.")


def _overridden() -> bool:
    return os.environ.get(OVERRIDE) == "1"


def refusal(version: str | None = None) -> str | None:
    """The problem with `version` that stops gridwright, or None: an untested version does
    not stop it while the override is set (refuse_untested then warns)."""
    problem = version_problem(version)
    return None if _overridden() else problem


def refuse_untested(version: str | None = None) -> None:
    """Raise UntestedDeepSpeed for an untested version, unless the override is set: then
    warn on stderr and go on (the fence's import calls it once per process)."""
    problem = version_problem(version)
    if problem is None:
        return
    if not _overridden():
        raise UntestedDeepSpeed(problem)
    print(f"WARNING: {OVERRIDE}=1: {problem.split(';')[0]}, untested; repairs in gridwright.deepspeed_internals "
          "may no longer fit it. Compare a run against one on the tested release before trusting it.",
          file=sys.stderr, flush=True)
