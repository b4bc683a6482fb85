"""A real headless browser for the UI tests: Debian's `chromium-headless-shell`, driven by
Playwright's Python package through `executable_path`.

Nothing is installed system-wide: the browser's package and the libraries it needs that a
bare Debian 12 lacks are fetched with `apt-get download`, unpacked with `dpkg -x` into a
cache folder once, and found through LD_LIBRARY_PATH. Playwright's own browser download
is not used: it needs a host the CI machines may not reach, and Debian's build is the
one the distribution keeps patched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("GRIDWRIGHT_BROWSER_CACHE", Path.home() / ".cache" / "gridwright-test-browser"))
BINARY = CACHE / "root" / "usr" / "lib" / "chromium" / "chromium-headless-shell"
# The browser, then what `ldd` found missing on a bare Debian 12 (bookworm), measured.
PACKAGES = ("chromium-headless-shell", "chromium-common", "libflac12", "libdouble-conversion3", "libharfbuzz-subset0",
            "libminizip1", "libopenh264-7", "libopenjp2-7", "libopus0", "libpulse0", "libasyncns0", "libogg0",
            "libsndfile1", "libmp3lame0", "libmpg123-0", "libvorbis0a", "libvorbisenc2", "libxnvctrl0")


class NoBrowser(Exception):
    """The machine cannot provide the browser (not Debian, or no package index)."""


def library_path() -> str:
    dirs = sorted({str(p.parent) for p in (CACHE / "root").rglob("*.so*")})
    return ":".join(dirs)


def missing_libraries() -> list[str]:
    env = {**os.environ, "LD_LIBRARY_PATH": library_path()}
    out = subprocess.run(["ldd", str(BINARY)], capture_output=True, text=True, env=env).stdout
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def ensure_browser() -> Path:
    """The browser's path, unpacked into the cache first if needed."""
    if BINARY.is_file() and not missing_libraries():
        return BINARY
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        raise NoBrowser("the UI tests unpack Debian's chromium-headless-shell: apt-get and dpkg are needed")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        fetched = subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, capture_output=True, text=True)
        if fetched.returncode != 0 and os.geteuid() == 0:  # a fresh machine's package lists may be empty
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            fetched = subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, capture_output=True, text=True)
        if fetched.returncode != 0:
            raise NoBrowser(f"apt-get download failed: {fetched.stderr.strip().splitlines()[-1:]}")
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(CACHE / "root")], check=True)
    missing = missing_libraries()
    if missing:
        raise NoBrowser(f"chromium-headless-shell still lacks {', '.join(missing)}")
    return BINARY


def launch(playwright):
    """A fresh headless Chromium (no profile: localStorage starts empty, as a new user's)."""
    path = ensure_browser()
    env = {**os.environ, "LD_LIBRARY_PATH": library_path()}
    return playwright.chromium.launch(executable_path=str(path), args=["--no-sandbox"], env=env)
