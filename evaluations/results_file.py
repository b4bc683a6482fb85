"""The one way an evaluation writes its results: `results/<benchmark>_<card>.md` (and `.json`).

One current file per benchmark and card: a new call replaces the file, atomically, and
git history keeps the calls before it. The file's first lines name the date, the commit
the call ran at and the command, so every file says how to reproduce it.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

from gridwright.basics.atomic_io import write_text_atomic

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evaluations" / "results"
CARD = re.compile(r"cpu|\d+x[a-z0-9]+")  # "cpu", "1xh200", "2xh100"


def card_of_this_machine() -> str:
    """`cpu`, or the GPU count and model: `1xh200` for one "NVIDIA H200"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    model = torch.cuda.get_device_name(0).split()[-1].lower()
    return f"{torch.cuda.device_count()}x{re.sub(r'[^a-z0-9]', '', model)}"


def results_path(out: Path, benchmark: str, card: str, suffix: str = ".md") -> Path:
    if not CARD.fullmatch(card):
        raise ValueError(f"card {card!r} is not 'cpu' or '<N>x<model>'")
    return Path(out) / f"{benchmark}_{card}{suffix}"


def commit_here() -> str:
    """The commit this checkout is at (`+` when it has uncommitted changes). A caller that
    names it in GRIDWRIGHT_COMMIT is believed first: the GPU machines get a copy of the
    working tree, whose git metadata (where any came along) need not be this commit's."""
    named = os.environ.get("GRIDWRIGHT_COMMIT", "")
    if named:
        return named
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    if head.returncode != 0:
        return ""
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def write_markdown(out: Path, benchmark: str, card: str, command: str, text: str, title: str | None = None) -> Path:
    """Replace `out/<benchmark>_<card>.md` with this call's table."""
    path = results_path(out, benchmark, card)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    commit = commit_here()
    at = f", at {commit}" if commit else ""
    Path(out).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, f"# {title or benchmark}: {card}, {when}{at}\n\nCommand: `{command.strip()}`\n\n{text}\n")
    return path


def write_json(out: Path, benchmark: str, card: str, data) -> Path:
    """Replace `out/<benchmark>_<card>.json`, the machine-readable twin of the table."""
    path = results_path(out, benchmark, card, ".json")
    Path(out).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    return path
