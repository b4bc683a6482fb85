"""One tested release of a library gridwright reaches inside, and what happens with another.

gridwright patches, repairs or calls private parts of Megatron-Core and DeepSpeed (behind
`megatron_internals` and `deepspeed_internals`) and of torch. Each patch is true of one
release (torch: of the two it is run on), so every fence works the same way: validation refuses another version in one line before
anything starts, the fence refuses it again at import where a job's workers run, and an
override environment variable lets a user try anyway, loudly.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class VersionFence:
    library: str  # as users name it: "Megatron-Core"
    pip_name: str  # as pip installs it: "megatron-core"
    tested: str  # the tested release; several: "2.13.0 2.11.0", the first the pin
    override: str  # the environment variable that lets another version run (=1)
    reaches: str  # what of gridwright's depends on the release, for the refusal
    fence_module: str  # where those patches live, for the warning
    installed_version: Callable[[], Optional[str]]
    error: type  # the RuntimeError subclass refuse_untested raises

    def version_problem(self, version: str | None = None) -> str | None:
        """One line naming the problem with `version` (default: the installed one), or None."""
        version = self.installed_version() if version is None else version
        tested = self.tested.split()
        if version is not None and version.split("+")[0] in tested:  # torch's "2.13.0+cpu" is 2.13.0
            return None
        found = "is not installed" if version is None else f"{version} is installed"
        names = " or ".join(f"{self.pip_name}=={t}" for t in tested)
        whose = "that release's" if len(tested) == 1 else "those releases'"
        return (f"{self.library} {found}; gridwright is tested with {names} only "
                f"({self.reaches} are {whose}). Fix: pip install {self.pip_name}=={tested[0]}, or set "
                f"{self.override}=1 to try anyway.")

    def overridden(self) -> bool:
        return os.environ.get(self.override) == "1"

    def refusal(self, version: str | None = None) -> str | None:
        """The problem with `version` that stops gridwright, or None: an untested version does
        not stop it while the override is set (refuse_untested then warns)."""
        problem = self.version_problem(version)
        return None if self.overridden() else problem

    def refuse_untested(self, version: str | None = None) -> None:
        """Raise `error` for an untested version, unless the override is set: then warn on
        stderr and go on (each fence's import calls it once per process)."""
        problem = self.version_problem(version)
        if problem is None:
            return
        if not self.overridden():
            raise self.error(problem)
        print(f"WARNING: {self.override}=1: {problem.split(';')[0]}, untested; patches in {self.fence_module} "
              "may no longer fit it. Compare a run against one on the tested release before trusting it.",
              file=sys.stderr, flush=True)
