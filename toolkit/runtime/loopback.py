"""This machine's loopback address and a free port on it, for one-node rendezvous (the
local launcher, the converter's logits check)."""
from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
# A one-node job's collectives bind to loopback too: left to choose, gloo and NCCL pick the
# first interface with an address, which on a machine without a route out (the GPU
# machines) may take connections nowhere.
LOOPBACK_SOCKETS = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
