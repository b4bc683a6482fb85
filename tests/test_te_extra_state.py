"""Transformer Engine's FP8 extra state is read without running code: the real state a TE
run wrote on an H200 reads, TE's format with a code-running recipe or tensor is refused
naming the global, and TE's own opt-in is set only around a load whose states were read."""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from checkpoint_payloads import Payload, te_extra_state

from gridwright.checkpoints.checkpoint_trust import UntrustedCheckpointFile, load_state_dict_vetted
from gridwright.checkpoints.te_extra_state import (
    TE_UNSAFE_PICKLE_ENV,
    UnsafeExtraState,
    is_extra_state_key,
    payload_bytes,
    read,
)
from gridwright.launchers.failure_report import _one_line

# Written by Megatron-Core's TE layer spec under FP8 delayed scaling (TE 2.19.0, 1 x H200):
# the extra state of one linear_proj, as tests/test_gpu_tier.py keeps it.
REAL = Path(__file__).parent / "data" / "te_extra_state_delayed.pkl"


def test_the_extra_state_a_te_run_wrote_reads_as_its_recipe_scales_and_histories():
    state = read(REAL.read_bytes())
    assert state.recipe == "TEDelayedScaling"  # Megatron-Core's subclass of TE's DelayedScaling
    assert state.recipe_fields["amax_history_len"] == 1024 and state.recipe_fields["margin"] == 0
    assert state.recipe_fields["fp8_format"] == ("Format", (448, 57344))  # HYBRID: E4M3 forward, E5M2 backward
    shapes = {k: tuple(v.shape) for k, v in state.tensors.items()}
    assert shapes == {"scale_fwd": (3,), "amax_history_fwd": (1024, 3), "scale_bwd": (2,), "amax_history_bwd": (1024, 2)}
    assert all(v.dtype == torch.float32 for v in state.tensors.values())
    assert state.tensors["amax_history_fwd"].abs().sum() > 0  # real amaxes, not a fresh state
    assert state.variables == {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448, "fp8_max_bwd": 57344}


def test_a_code_running_recipe_in_tes_format_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "marker"
    data = te_extra_state(Payload(marker, 0))
    with pytest.raises(UnsafeExtraState) as refused:
        read(data)
    assert refused.value.needs == "builtins.eval" and not marker.exists()
    pickle.loads(data)  # the payload is live
    assert marker.exists()


def test_a_tensor_that_names_a_foreign_global_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    data = pickle.dumps({"recipe": None, "scale_fwd": Evil()})
    with pytest.raises(UnsafeExtraState, match="posix.system"):
        read(data)


def test_only_tes_own_shapes_are_read():
    assert payload_bytes(None) is None and payload_bytes(torch.empty(0, dtype=torch.uint8)) is None
    assert payload_bytes(torch.frombuffer(bytearray(b"\x80\x04N."), dtype=torch.uint8)) == b"\x80\x04N."
    for value, says in ((torch.zeros(3), "torch.float32"), (torch.zeros(2, 2, dtype=torch.uint8), "shape (2, 2)"),
                        (io.BytesIO(b"x"), "io.BytesIO"), ([1], "list")):
        with pytest.raises(UnsafeExtraState, match=says.replace("(", r"\(").replace(")", r"\)")):
            payload_bytes(value)
    with pytest.raises(UnsafeExtraState, match="at the top"):
        read(pickle.dumps([1, 2]))
    with pytest.raises(UnsafeExtraState, match="readable pickle"):
        read(REAL.read_bytes()[:100])
    assert is_extra_state_key("decoder.layers.mlp.linear_fc1._extra_state/shard_0_4")
    assert not is_extra_state_key("rng_state/shard_0_1")


class SeesTheSwitch(torch.nn.Module):
    """A module whose extra state records TE's opt-in at the moment it is loaded."""

    def __init__(self):
        super().__init__()
        self.seen = "never loaded"

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.seen = os.environ.get(TE_UNSAFE_PICKLE_ENV)


def tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_tes_opt_in_covers_exactly_one_load_of_states_that_were_read(monkeypatch, tmp_path):
    monkeypatch.delenv(TE_UNSAFE_PICKLE_ENV, raising=False)
    module = SeesTheSwitch()
    load_state_dict_vetted(module, {"_extra_state": tensor(REAL.read_bytes())}, "iter_3")
    assert module.seen == "1" and TE_UNSAFE_PICKLE_ENV not in os.environ
    load_state_dict_vetted(module, {"_extra_state": torch.empty(0, dtype=torch.uint8)}, "iter_3")
    assert module.seen is None  # nothing to unpickle: no opt-in
    module.seen = "untouched"
    marker = tmp_path / "marker"
    with pytest.raises(UntrustedCheckpointFile, match=r"iter_3 \(Transformer Engine extra state '_extra_state'\) "
                                                      r"needs builtins\.eval"):
        load_state_dict_vetted(module, {"_extra_state": tensor(te_extra_state(Payload(marker, 0)))}, "iter_3")
    assert module.seen == "untouched" and not marker.exists() and TE_UNSAFE_PICKLE_ENV not in os.environ


def test_a_long_failure_keeps_its_advice_whole():
    te = ("RuntimeError: Refusing to load pickled Transformer Engine extra state for TERowParallelLinear. "
          "Delayed-scaling FP8 metadata can be stored as a Python pickle, and loading it can execute arbitrary "
          "code. Only enable unsafe loading if this checkpoint is from a trusted source. To load it anyway, set "
          "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.")
    line = _one_line(te)
    assert len(line) <= 300 and line.startswith("RuntimeError: Refusing to load pickled Transformer Engine")
    assert line.endswith(" ... To load it anyway, set NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.")
    assert _one_line("x" * 400) == "x" * 297 + "..."  # no advice: the head
