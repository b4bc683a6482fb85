"""Transformer Engine's FP8 extra state, read without running code it may carry.

TE keeps each FP8 module's metadata as `_extra_state`: a uint8 tensor holding a Python
pickle (TE 2.19, `module/base.py`, `get_extra_state`). Under delayed scaling that pickle
is a dict of the recipe (a `transformer_engine.common.recipe` dataclass, its `Format`
enum), the forward and backward scales and amax histories (CPU tensors, which pickle
through `torch._utils._rebuild_tensor_v2` and `torch.storage._load_from_bytes`) and
plain values (`extra_fp8_variables`). Stateless recipes (current scaling, blockwise,
MXFP8) write an empty tensor. TE 2.19 refuses to unpickle a non-empty one unless
`NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1` is set for the process, which would admit any
checkpoint's code, so a TE FP8 run could not resume its own checkpoint safely.

Here each payload is read by a restricted unpickler that admits exactly those types:
TE's recipe records become neutral stand-ins (no TE import, so the check also runs on a
machine without CUDA), tensors are rebuilt by torch's weights-only reader, and any other
global is refused, naming it. `load_vetted` then hands TE the very bytes that passed,
with TE's opt-in set only for that `load_state_dict` call. A tensor format of our own was
the other choice; it would make gridwright's checkpoints unreadable by plain
Megatron-Core and TE, so TE's format stays on disk. `checkpoint_trust` turns a refusal
into the one-line checkpoint refusal every other file gets.
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
from dataclasses import dataclass, field

# TE's switch for its own pickle loader (transformer_engine/pytorch/_extra_state.py)
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# The records an extra state can hold: TE's recipes, their format enum and its value type,
# the dataclasses the newer recipes nest (TE 2.19), and Megatron-Core's own subclass of
# DelayedScaling, which its TE layers hand to TE (extensions/transformer_engine.py in
# 0.16.1; seen in the extra state a GPU run wrote, tests/data/te_extra_state_delayed.pkl).
ADMITTED = {(TE_RECIPE_MODULE, name) for name in (
    "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling",
    "Format", "_FormatHelper", "MMParams", "QParams")} | {("megatron.core.extensions.transformer_engine",
                                                           "TEDelayedScaling")}
# An extra state holds a few scales and amax histories (1,024 rows by default): far below this.
MOST_BYTES = 64 * 2**20
EXTRA_STATE_SUFFIX = "_extra_state"


class UnsafeExtraState(RuntimeError):
    """A TE extra state that needs a global outside the admitted set (`needs`)."""

    def __init__(self, needs: str):
        self.needs, self.key = needs, None
        super().__init__(needs)


@dataclass
class ExtraState:
    """What one TE extra state holds, as plain values: the recipe's class name and fields,
    its tensors (scales, amax histories) and its other variables."""

    recipe: str | None
    recipe_fields: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    variables: dict = field(default_factory=dict)


class _Record:
    """Stand-in for one of TE's recipe records: keeps what the pickle gives it."""

    def __new__(cls, *args, **kwargs):
        record = object.__new__(cls)
        record.args = args
        return record

    def __setstate__(self, state):
        self.fields = state[0] if isinstance(state, tuple) and state and isinstance(state[0], dict) else state


def _stand_ins() -> dict:
    """Fresh stand-in classes for each read, so that nothing a payload does to one (BUILD
    on a class) outlives it."""
    out = {key: type(key[1], (_Record,), {"__module__": __name__}) for key in ADMITTED}
    # an enum member pickles as Format(value)
    out[(TE_RECIPE_MODULE, "Format")] = lambda value: ("Format", getattr(value, "args", value))
    return out


def _storage_from_bytes(data: bytes):
    """`torch.storage._load_from_bytes` through torch's weights-only reader (a storage saved
    in torch's legacy format: nothing but the storage is admitted)."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeExtraState(f"a storage that torch's weights-only reader refuses ({str(e).splitlines()[0][:120]})") from None


class _ExtraStateUnpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.stand_ins = _stand_ins()

    def find_class(self, module: str, name: str):
        import torch._utils

        if (module, name) in self.stand_ins:
            return self.stand_ins[module, name]
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return torch._utils._rebuild_tensor_v2
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise UnsafeExtraState(f"{module}.{name}")

    def persistent_load(self, pid):
        raise UnsafeExtraState("a persistent id")


def payload_bytes(value) -> bytes | None:
    """The pickle inside one `_extra_state` value (None where there is none to read:
    None, an empty tensor). Anything else than a uint8 tensor or bytes is refused."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise UnsafeExtraState(f"a {value.dtype} tensor of shape {tuple(value.shape)} (TE writes 1-D uint8)")
        return value.detach().cpu().numpy().tobytes()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value) or None
    if isinstance(value, io.BytesIO):  # TE's deprecated form: a torch.save inside
        raise UnsafeExtraState("io.BytesIO (TE's deprecated extra-state form)")
    raise UnsafeExtraState(type(value).__qualname__)


def read(data: bytes) -> ExtraState:
    """One extra state's pickle, decoded without running code; raises UnsafeExtraState."""
    if len(data) > MOST_BYTES:
        raise UnsafeExtraState(f"{len(data):,} bytes (an extra state holds at most {MOST_BYTES:,})")
    try:
        state = _ExtraStateUnpickler(io.BytesIO(data)).load()
    except UnsafeExtraState:
        raise
    except Exception as e:  # truncated, or a well-formed pickle of the wrong shape
        raise UnsafeExtraState(f"a readable pickle ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise UnsafeExtraState(f"a dict at the top (found {type(state).__name__})")
    recipe = state.get("recipe")
    tensors = {k: v for k, v in state.items() if k not in ("recipe", "extra_fp8_variables")}
    return ExtraState(
        recipe=type(recipe).__name__ if isinstance(recipe, _Record) else None,
        recipe_fields=dict(getattr(recipe, "fields", None) or {}),
        tensors=tensors,
        variables=dict(state.get("extra_fp8_variables") or {}),
    )


def read_all(state: dict) -> int:
    """Read every `_extra_state` of a (nested) loaded state dict; returns how many held a
    pickle. Raises UnsafeExtraState with the key in `key`."""
    count = 0
    for key, value in extra_states(state):
        # Megatron-Core keeps a stacked layer's extra states as a list, one per layer
        for item in value if isinstance(value, (list, tuple)) else [value]:
            try:
                data = payload_bytes(item)
                if data is not None:
                    read(data)
                    count += 1
            except UnsafeExtraState as e:
                e.key = key
                raise
    return count


def extra_states(state: dict, prefix: str = ""):
    """(key, value) of every `_extra_state` entry of a nested state dict."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from extra_states(value, name + ".")
        elif is_extra_state_key(str(key)):
            yield name, value


def is_extra_state_key(key: str) -> bool:
    """A module's `_extra_state`, also as a checkpoint object's name: Megatron-Core stores
    it as a ShardedObject, whose name in DCP's index is "KEY/shard_OFFSET_SHAPE"."""
    return key.split("/", 1)[0].endswith(EXTRA_STATE_SUFFIX)


@contextlib.contextmanager
def te_reads_vetted_pickles():
    """TE's opt-in for its own pickle loader, for one load of extra states that `read_all`
    read first (the same in-memory bytes), restored afterwards."""
    before = os.environ.get(TE_UNSAFE_PICKLE_ENV)
    os.environ[TE_UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TE_UNSAFE_PICKLE_ENV, None)
        else:
            os.environ[TE_UNSAFE_PICKLE_ENV] = before
