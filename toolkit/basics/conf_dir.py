"""Where the Hydra config tree (`conf/`) is: read by composition and by the few readers
below it that need a preset's values (a checkpoint's model shape, for its Fix)."""
from __future__ import annotations

import os
from pathlib import Path


def _conf_dir() -> Path:
    """GRIDWRIGHT_CONF if set; else the installed package's `conf/` (a wheel carries it as
    package data), else the repository's (`toolkit/../conf`, an editable install)."""
    if os.environ.get("GRIDWRIGHT_CONF"):
        return Path(os.environ["GRIDWRIGHT_CONF"])
    package = Path(__file__).resolve().parents[1]  # gridwright/ (toolkit/ in the repository)
    return package / "conf" if (package / "conf" / "config.yaml").is_file() else package.parent / "conf"


CONF_DIR = _conf_dir()
# The groups of presets applied on top (`+experiment=NAME`, `+bench=NAME`): a user's, then
# the benchmarks' and evaluation sweeps'.
PRESET_GROUPS = ("experiment", "bench")
