"""How long a collective may wait for its peers before torch.distributed raises."""
from __future__ import annotations

from datetime import timedelta

# What the watchdog needs after a bound passes to name the stuck rank: a poll (1 s), the
# stack dump (3 s), writing its finding and ending the node's workers. A collective that
# times out first would end the healthy peer waiting in it and blame that one instead.
WATCHDOG_FIRST_S = 60.0


def collective_timeout(watchdog, backend: str, longest_bound_s: float = 0.0) -> timedelta:
    """`watchdog.collective_timeout_s`, or by default the longest bound the watchdog allows
    (`watchdog.phase_timeout_s`, or `longest_bound_s`: a first save's) plus
    WATCHDOG_FIRST_S, on every backend. The timeout is the backstop for what the watchdog
    cannot see (a rank on another node), and must not cut a save, load or compile the
    watchdog allows (ranks wait for the slowest in the collective after it)."""
    seconds = watchdog.collective_timeout_s
    if seconds is None:
        seconds = max(watchdog.phase_timeout_s, longest_bound_s) + WATCHDOG_FIRST_S
    return timedelta(seconds=seconds)


def first_save_bound_s(cfg) -> float:
    """The watchdog's bound on this run's first save (0 without saves): the collective
    timeout must outlast it."""
    from ..planning.disk_space import checkpoint_bytes
    from ..runtime.heartbeat import save_bound_s

    if not cfg.checkpoint.save:
        return 0.0
    return save_bound_s(checkpoint_bytes(cfg.model, cfg.precision), None, cfg.watchdog.save_floor_s)
