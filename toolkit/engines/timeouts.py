"""How long a collective may wait for its peers before torch.distributed raises."""
from __future__ import annotations

from datetime import timedelta

# gloo is CPU: a rank may compile (inductor's C++ build, DeepSpeed's ops) for minutes while
# its peers wait in the next collective.
DEFAULT_S = {"nccl": 600.0, "gloo": 900.0}


def collective_timeout(cfg, backend: str) -> timedelta:
    """`watchdog.collective_timeout_s`, or the backend's default."""
    seconds = cfg.watchdog.collective_timeout_s
    return timedelta(seconds=DEFAULT_S[backend] if seconds is None else seconds)
