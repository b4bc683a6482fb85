"""Environment every launcher gives its workers."""
from __future__ import annotations

# NVLink multicast (NVLS) is left off: on the shared GPU machines it can hang or corrupt
# other tenants' collectives, and the toolkit must behave the same on every cluster.
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def worker_env(cfg) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if cfg.cluster.device == "cuda":
        env.update(NCCL_ENV)
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(max_connections(cfg))
    else:  # DeepSpeed otherwise looks for an accelerator and warns that it found none
        env["DS_ACCELERATOR"] = "cpu"
        # One thread per rank: ranks share the cores, and oversubscribed threads made a
        # CPU step 9x slower (5.36 s vs 0.60 s measured with two ranks on 2 cores).
        env["OMP_NUM_THREADS"] = "1"
    return env


def max_connections(cfg) -> int:
    """CUDA_DEVICE_MAX_CONNECTIONS (hardware queues per GPU): engine.cuda_device_max_connections,
    else what the engine's rules ask for."""
    from ..engines.registry import rules

    if cfg.engine.cuda_device_max_connections is not None:
        return cfg.engine.cuda_device_max_connections
    return rules(cfg).cuda_device_max_connections(cfg)
