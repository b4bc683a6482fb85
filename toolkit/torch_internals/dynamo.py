"""torch.compile's private knobs: the recompile limit and the count of compiled graphs.
Both are attributes of `torch._dynamo`, cited in `versions.torch_version.PRIVATE_CALLS`."""
from __future__ import annotations


def raise_recompile_limit(layers: int) -> None:
    """Room for a graph per layer (and per layer's backward) before dynamo gives up and
    runs layers eagerly without a word (its default limit is 8)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 2 * layers + 8))


def compiled_graphs() -> int:
    """Graphs torch.compile produced in this process (the summary's proof that compiling ran)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
