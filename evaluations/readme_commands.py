"""Run every command of the README and the docs/ pages as written, in a fresh clone, and table what happened.

    python -m gridwright.evaluations.readme_commands                 # CPU commands, fresh clone of HEAD + venv
    python -m gridwright.evaluations.readme_commands --working-tree  # the same, with this checkout's uncommitted edits
    python -m gridwright.evaluations.readme_commands --gpu --here    # the GPU machine's commands, in place
    python -m gridwright.evaluations.readme_commands --list          # print the parsed commands per page, run nothing

Commands are the lines of the ```bash blocks (continuations joined, comments split off)
of README.md, then of docs/*.md in alphabetical order, all run in one directory: a page's
commands may use what an earlier page's commands made (docs/checkpoints.md saves the
checkpoint docs/conversion.md converts). A command whose comment says "GPU machine" runs
only with `--gpu`; the others run only without it. `<time>-<id>` in a path stands for the
newest directory an earlier command made there; a command whose directory does not exist
yet is skipped with that reason. The quick start's install runs in a virtual environment
of the clone that sees this interpreter's packages (so the clone's own code is what runs);
its test commands are left to CI (`.ci/run` runs them) unless `--with-tests`.

The table goes to stdout and, with the log of every command's output, to `--out` (default:
a new temporary directory, whose path is printed). These are CI logs: nothing is written
into the repository.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gridwright.basics.atomic_io import write_text_atomic
from gridwright.runtime.process_tree import run_bounded


def _checkout() -> Path:
    """The checkout whose pages run: the one this module lies in (an editable install), or,
    where gridwright is installed from a wheel (as on the GPU machines, whose copy of the
    working tree is the current directory), the current directory."""
    mine = Path(__file__).resolve().parents[1]
    return mine if (mine / "README.md").is_file() else Path.cwd()


REPO = _checkout()
GPU_MARK = "GPU machine"
PLACEHOLDER = "<time>-<id>"
COMMENT = re.compile(r"\s+#\s")
TEST_COMMAND = re.compile(r"^python -m pytest\b")


@dataclass
class Command:
    line: str
    comment: str
    gpu: bool
    page: str = "README.md"


@dataclass
class Outcome:
    command: str
    status: str  # ok | failed | skipped
    exit_code: int | None
    seconds: float
    note: str
    page: str = "README.md"


def readme_commands(readme: Path, page: str | None = None) -> list[Command]:
    """Every command of one Markdown page's bash blocks, in order."""
    page = page or readme.name
    out, in_block, pending = [], False, ""
    for raw in readme.read_text().splitlines():
        if raw.startswith("```"):
            in_block = raw.strip() == "```bash" if not in_block else False
            continue
        if not in_block:
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        if not line or line.startswith("#"):
            continue
        parts = COMMENT.split(line, maxsplit=1)
        comment = parts[1].strip() if len(parts) > 1 else ""
        out.append(Command(parts[0].strip(), comment, GPU_MARK in comment, page))
    return out


def pages(root: Path) -> list[Path]:
    """The pages whose commands run, in the order they run: README.md, then docs/*.md alphabetically."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def documented_commands(root: Path) -> list[Command]:
    """Every command of every page, in the order they run."""
    return [cmd for path in pages(root) for cmd in readme_commands(path, str(path.relative_to(root)))]


def resolve_placeholders(line: str, cwd: Path) -> tuple[str | None, str]:
    """Replace `DIR/<time>-<id>` by the newest directory in DIR; (None, why) when there is none."""
    for token in line.split():
        if PLACEHOLDER not in token:
            continue
        parent = cwd / token.split(PLACEHOLDER)[0]
        found = sorted((p for p in parent.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime) \
            if parent.is_dir() else []
        if not found:
            return None, f"no directory under {token.split(PLACEHOLDER)[0]} yet (made by a GPU-machine command)"
        line = line.replace(token, str(found[-1].relative_to(cwd)))
    return line, ""


def run(cmd: Command, cwd: Path, env: dict, timeout: int, log) -> Outcome:
    line, why = resolve_placeholders(cmd.line, cwd)
    if line is None:
        return Outcome(cmd.line, "skipped", None, 0.0, why, cmd.page)
    print(f"$ {line}    [{cmd.page}]", flush=True)
    start = time.perf_counter()
    # a command that starts workers (a launch) is ended with all of them past its timeout (exit 124)
    done = run_bounded(["bash", "-c", line], timeout, grace_s=10, cwd=cwd, env=env)
    code, out, err = done.returncode, done.stdout, done.stderr
    seconds = time.perf_counter() - start
    log.write(f"$ {line}    [{cmd.page}]\n{out}\n{err}\n[exit {code}, {seconds:.1f} s]\n\n")
    log.flush()
    # A success is told by its last word on stdout; a failure by its error on stderr.
    text = out if code == 0 and out.strip() else err + "\n" + out
    last = next((l for l in reversed(text.strip().splitlines()) if l.strip()), "")
    status = "ok" if code == 0 else "failed"
    print(f"  -> {status} ({code}) in {seconds:.1f} s: {last[:160]}", flush=True)
    return Outcome(line, status, code, seconds, last[:200], cmd.page)


def fresh_clone(tmp: Path, working_tree: bool = False) -> tuple[Path, dict]:
    """A clone of this repository's HEAD (with `working_tree`, this checkout's uncommitted
    edits copied over it) and a venv that sees this interpreter's packages."""
    clone = tmp / "gridwright"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    if working_tree:
        overlay_working_tree(clone)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
    return clone, env


def overlay_working_tree(clone: Path) -> None:
    """Make the clone's files this checkout's: every tracked or untracked file git does not
    ignore is copied, and tracked files deleted here are deleted there."""
    def git_files(*flags) -> list[str]:
        out = subprocess.run(["git", "ls-files", "-z", *flags], cwd=REPO, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]

    deleted = set(git_files("--deleted"))
    for rel in git_files("--cached", "--others", "--exclude-standard"):
        src, dst = REPO / rel, clone / rel
        if rel in deleted or not src.exists():
            dst.unlink(missing_ok=True)
            continue
        if src.is_dir():  # a submodule or nested repository: not carried
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="run the commands marked for the GPU machine instead")
    ap.add_argument("--here", action="store_true", help="run in this checkout (no clone, no venv)")
    ap.add_argument("--working-tree", action="store_true",
                    help="clone, then copy this checkout's uncommitted edits (untracked files too) over the clone")
    ap.add_argument("--with-tests", action="store_true", help="also run the quick start's test commands")
    ap.add_argument("--only", help="run only the commands this regular expression finds (others: skipped)")
    ap.add_argument("--list", action="store_true", help="print the commands each page yields, and run nothing")
    ap.add_argument("--launch-extra", default="", help="overrides appended to every `python launch.py` command "
                    "(e.g. tracking=off on a machine without MLflow); stated in the table")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per command")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the table and the log (default: a new temporary directory, printed)")
    args = ap.parse_args(argv)
    if not (REPO / "README.md").is_file():
        print(f"error: no README.md in {REPO}: run this from a gridwright checkout.", file=sys.stderr)
        return 2
    if args.list:
        for cmd in documented_commands(REPO):
            print(f"{cmd.page:28} {'gpu' if cmd.gpu else 'cpu'}  {cmd.line}")
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    kind = "gpu" if args.gpu else "cpu"
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="gridwright-readme-report-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"report and log: {out_dir}", flush=True)
    log_path = out_dir / f"readme_commands_{kind}_{stamp}.log"
    where = "this checkout" if args.here else ("fresh clone with the working tree" if args.working_tree
                                               else "fresh clone")
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="gridwright-readme-") as tmp, open(log_path, "w") as log:
        cwd, env = (REPO, dict(os.environ)) if args.here else fresh_clone(Path(tmp), args.working_tree)
        for cmd in documented_commands(cwd):
            def skip(why: str) -> None:
                outcomes.append(Outcome(cmd.line, "skipped", None, 0.0, why, cmd.page))

            if cmd.gpu != args.gpu:
                skip("GPU machine (run with --gpu there)" if cmd.gpu else "CPU command")
            elif args.only and not re.search(args.only, cmd.line):
                skip(f"not selected (--only {args.only})")
            elif TEST_COMMAND.match(cmd.line.strip()) and not args.with_tests:
                skip("the test suite: .ci/run runs it")
            elif "readme_commands" in cmd.line:
                skip("this runner")
            else:
                if args.launch_extra and cmd.line.startswith("python launch.py"):
                    cmd = Command(f"{cmd.line} {args.launch_extra}", cmd.comment, cmd.gpu, cmd.page)
                outcomes.append(run(cmd, cwd, env, args.timeout, log))
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "failed", "skipped")}
    lines = [f"# Documented commands ({kind}; {where} of {commit}, "
             f"{platform.node()}, {datetime.datetime.now():%Y-%m-%d %H:%M})", "",
             *([f"Appended to every `python launch.py` command: `{args.launch_extra}`.", ""] if args.launch_extra else []),
             f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped. Output: `{log_path}`.", "",
             "| # | page | command | status | exit | s | last line / reason |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, o in enumerate(outcomes, 1):
        cell = o.note.replace("|", "\\|")
        lines.append(f"| {i} | {o.page} | `{o.command[:150]}` | {o.status} | "
                     f"{'' if o.exit_code is None else o.exit_code} | {o.seconds:.0f} | {cell} |")
    text = "\n".join(lines) + "\n"
    print(text)
    table = out_dir / f"readme_commands_{kind}_{stamp}.md"
    write_text_atomic(table, text)
    write_text_atomic(table.with_suffix(".json"), json.dumps([asdict(o) for o in outcomes], indent=1))
    print(f"wrote {table} (and .json, .log)")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
