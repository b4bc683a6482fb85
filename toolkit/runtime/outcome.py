"""What one launch came to: the exit code of `launch.py` and a sweep's record of the point
are both derived from it, so neither has to reconstruct what the other saw."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EXIT_INVALID = 2  # bad input: refused before anything started


@dataclass(frozen=True)
class Outcome:
    # finished | failed | killed (a local run's end) | planned (plan printed or job script
    # written: nothing ran here) | invalid (refused before anything started) | idle
    # (a re-run with nothing left to train)
    status: str
    exit_code: int = 0
    job_dir: Path | None = None
    problems: tuple[str, ...] = ()  # why it was invalid, one item per problem
    run_id: str | None = None  # the job's MLflow run, when this launch opened one

    @classmethod
    def invalid(cls, problems) -> "Outcome":
        return cls("invalid", EXIT_INVALID, problems=tuple(str(p) for p in problems))
