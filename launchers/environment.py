"""Environment every launcher gives its workers."""
from __future__ import annotations


def worker_env(cfg) -> dict[str, str]:
    """What gridwright sets, then the cluster's own `cluster.env`, which wins."""
    env = {"PYTHONUNBUFFERED": "1"}
    if cfg.cluster.device == "cuda":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(max_connections(cfg.engine, cfg.parallel))
    else:  # DeepSpeed otherwise looks for an accelerator and warns that it found none
        env["DS_ACCELERATOR"] = "cpu"
        # One thread per rank: ranks share the cores, and oversubscribed threads made a
        # CPU step 9x slower (5.36 s vs 0.60 s measured with two ranks on 2 cores).
        env["OMP_NUM_THREADS"] = "1"
    env.update({str(k): str(v) for k, v in cfg.cluster.env.items()})
    return env


def max_connections(engine, parallel) -> int:
    """CUDA_DEVICE_MAX_CONNECTIONS (hardware queues per GPU): engine.cuda_device_max_connections,
    else what the engine's rules ask for."""
    from ..engine_rules.registry import rules

    if engine.cuda_device_max_connections is not None:
        return engine.cuda_device_max_connections
    return rules(engine).cuda_device_max_connections(engine, parallel)
