"""How a refusal's advice is written and read: its first suggestion after `Fix: ` is a run of
Hydra overrides (`fix_overrides` reads them back), tried on the config before it is offered.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from omegaconf import OmegaConf


# Fixes ----------------------------------------------------------------------
# A problem's advice follows "Fix: ". Its first suggestion is either a run of Hydra
# overrides (`key=value` words, ended by punctuation or by the first other word), which
# `fix_overrides` reads and a user or a tool adds to the command line, or, where no
# override helps, an action in words ("rm ... && python -m ..."). Where the override is
# computed (a divisor, a layout, a memory saving) it was tried on the config first: it
# answers the problem, passes the layout rules, and never repeats a value already set.
OVERRIDE_WORD = re.compile(r"[+~]?[A-Za-z_][\w.]*=\S+")


def fix_overrides(problem: str) -> list[str] | None:
    """The first suggestion of `problem`'s Fix as overrides; None where it is an action in words."""
    if "Fix: " not in problem:
        return None
    out = []
    for word in problem.split("Fix: ", 1)[1].split():
        bare = word.rstrip(",;.")
        if not OVERRIDE_WORD.fullmatch(bare):
            break
        out.append(bare)
        if bare != word:  # punctuation ends the suggestion
            break
    return out or None


def override_words(overrides: dict) -> str:
    """Overrides as command-line words: `parallel.tp=4 parallel.sp=true`."""
    def value(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return " ".join(f"{k}={value(v)}" for k, v in overrides.items())


def fix_text(found: dict | None, otherwise: str) -> str:
    """The Fix: the overrides found, or the advice in words where none were found."""
    return f"Fix: {override_words(found)}" if found else f"Fix: {otherwise}"


def nearest_first(current: int, options) -> list[int]:
    """`options` other than `current`, nearest first: the smaller ones downwards, then the larger."""
    return sorted((o for o in options if o < current), reverse=True) + sorted(o for o in options if o > current)


@contextmanager
def tried_with(cfg, overrides: dict):
    """`cfg` as a fix would leave it: the dotted `overrides` applied in place, and undone on
    leaving (a fix search tries dozens; copying the config costs more than checking it)."""
    before = {key: OmegaConf.select(cfg, key) for key in overrides}
    try:
        for key, value in overrides.items():
            OmegaConf.update(cfg, key, value, merge=False)
        yield cfg
    finally:
        for key, value in before.items():
            OmegaConf.update(cfg, key, value, merge=False)


def option_keys(group: str, option: str) -> dict | None:
    """A group's option (`precision=bf16`: conf/precision/bf16.yaml) as the dotted keys it
    sets, as a fix or an advised layout applies it to a composed config; None where the
    group has no such option."""
    from ..basics.conf_dir import CONF_DIR

    path = CONF_DIR / group / f"{option}.yaml"
    if "." in group or not path.is_file():
        return None
    values = OmegaConf.to_container(OmegaConf.load(path))
    return {f"{group}.{k}": v for k, v in values.items() if k != "defaults"}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def yaml_value(text: str):
    """A command-line value as Hydra reads it (`true`, `8`, `null`, `[1,3]`, a string)."""
    import yaml

    return yaml.safe_load(text)
