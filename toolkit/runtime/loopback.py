"""This machine's loopback address and a free port on it, for one-node rendezvous (the
local launcher, the converter's logits check)."""
from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
