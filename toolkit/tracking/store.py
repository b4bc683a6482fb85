"""Whether a run's MLflow store can be used, asked before anything starts, and how long
a call to a tracking server may wait. Without importing MLflow (it takes seconds): a
SQLite store is opened with the standard library, a server is asked for its `/health`."""
from __future__ import annotations

import os
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path

PROBE_TIMEOUT_S = 5.0
# MLflow's own defaults retry a request 7 times with backoff and wait 120 s for each
# answer: an unreachable server held a run for about 250 s (measured). With these, one
# call gives up after 3 tries of at most 10 s each, plus 1 + 2 s of backoff: about 33 s.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
HTTP_WAIT_BOUND_S = 33


def absolute_uri(uri: str) -> str:
    """A relative SQLite path made absolute (against the current directory)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def tracking_uri(tracking) -> str:
    """MLFLOW_TRACKING_URI wins (a remote server); else the tracking group's store, made absolute."""
    return absolute_uri(os.environ.get("MLFLOW_TRACKING_URI") or tracking.uri)


def bound_http_waits() -> None:
    """Apply HTTP_BOUNDS to this process (and its children), unless the user set them."""
    for key, value in HTTP_BOUNDS.items():
        os.environ.setdefault(key, value)


def store_problem(uri: str) -> str | None:
    """Why the store at `uri` cannot be used, or None. A SQLite file that does not exist
    yet is fine (the first run creates it)."""
    if uri.startswith("sqlite:///"):
        return _sqlite_problem(Path(uri[len("sqlite:///"):]))
    if uri.startswith(("http://", "https://")):
        return _server_problem(uri)
    return None


def _sqlite_problem(path: Path) -> str | None:
    from ..basics.path_rules import system_place, what_is

    found = what_is(path)
    if found == "nothing":  # created by the first run, in a directory that must exist already
        if not path.parent.is_dir():
            return (f"the MLflow store {path} would go into {path.parent}, which does not exist (gridwright "
                    f"creates no directories for a store). Fix: mkdir -p {path.parent}, or "
                    "tracking.uri=sqlite:///mlflow.db")
        if system_place(path.parent):
            return f"the MLflow store {path}: {system_place(path.parent)}. Fix: tracking.uri=sqlite:///mlflow.db"
        return None
    if found != "a regular file" and not (found.startswith("a symbolic link") and path.is_file()):
        return f"the MLflow store {path} is {found}, not a regular file: refused. Fix: tracking.uri=sqlite:///mlflow.db"
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=PROBE_TIMEOUT_S) as con:
            verdict = con.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.Error as e:
        return f"the MLflow store {path} cannot be opened ({e})"
    finally:
        con = None
    if verdict != "ok":
        return f"the MLflow store {path} is damaged (SQLite's check: {verdict})"
    return None


def _server_problem(uri: str) -> str | None:
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as answer:
            if answer.status == 200:
                return None
            return f"the tracking server {uri} answered {url} with HTTP {answer.status}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"the tracking server {uri} did not answer within {PROBE_TIMEOUT_S:g} s ({reason})"
