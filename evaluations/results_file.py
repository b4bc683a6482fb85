"""The one way an evaluation writes its table: `results/<name>_<stamp>.md`, titled, with the
command that made it, so every file says how to reproduce it."""
from __future__ import annotations

import datetime
from pathlib import Path


def stamp_now() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M")


def write_markdown(out: Path, name: str, command: str, text: str, stamp: str | None = None,
                   title: str | None = None) -> Path:
    stamp = stamp or stamp_now()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{stamp}.md"
    path.write_text(f"# {title or name}, {stamp}\n\nCommand: `{command.strip()}`\n\n{text}\n")
    return path
