"""The documentation's commands and links: what `gridwright.evaluations.readme_commands`
reads from README.md and docs/*.md, and that every relative link lands on a file (and a
heading) that exists. Running the commands themselves is the runner's job (CI), not this
test's."""
import importlib.util
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from gridwright.evaluations import readme_commands as rc

ROOT = Path(__file__).resolve().parents[1]
PAGES = rc.pages(ROOT)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"-m (gridwright(?:\.\w+)*)")


def test_pages_are_the_readme_then_docs_alphabetically():
    assert PAGES[0] == ROOT / "README.md"
    docs = PAGES[1:]
    assert docs and docs == sorted(docs) and all(p.parent == ROOT / "docs" for p in docs)


def test_the_quick_start_comes_first_and_its_tests_are_skipped():
    cmds = rc.documented_commands(ROOT)
    assert [c.line for c in cmds[:2]] == [
        "DS_BUILD_OPS=0 pip install -e '.[test]' && python launch.py",
        'python -m pytest -m "not slow" && python -m pytest -m slow',
    ]
    assert rc.TEST_COMMAND.match(cmds[1].line) and not rc.TEST_COMMAND.match(cmds[0].line)
    assert {c.page for c in cmds} >= {"README.md", "docs/conversion.md", "docs/checkpoints.md"}


def test_parsing_joins_continuations_and_splits_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```bash\n# a comment line\npython launch.py a=1 \\\n    b=2   # on the GPU machine\n"
                    "python x.py\n```\n```text\nnot a command\n```\n")
    cmds = rc.readme_commands(page, "docs/page.md")
    assert [(c.line, c.gpu, c.page) for c in cmds] == [("python launch.py a=1 b=2", True, "docs/page.md"),
                                                      ("python x.py", False, "docs/page.md")]


def test_a_page_uses_only_what_an_earlier_page_made():
    """conversion.md converts the checkpoint checkpoints.md saves: the order must keep it so."""
    cmds = rc.documented_commands(ROOT)
    saved = next(i for i, c in enumerate(cmds) if "checkpoint.save=ckpt/run1" in c.line)
    converted = next(i for i, c in enumerate(cmds) if "--megatron ckpt/run1" in c.line)
    assert saved < converted


def test_every_documented_module_exists():
    for path in PAGES:
        for module in set(MODULE.findall(path.read_text())):
            assert importlib.util.find_spec(module) is not None, f"{path.name}: python -m {module} does not exist"


def _prose(page: Path) -> str:
    """The page without its fenced blocks (a fence is a line that starts with ```)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", page.read_text(), flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", _prose(page), flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_land(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_list_prints_every_page_s_commands(capsys):
    assert rc.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == len(rc.documented_commands(ROOT)) and "docs/conversion.md" in out


def test_the_report_goes_to_a_temporary_directory_by_default(capsys):
    """CI logs, not commits: nothing is written into evaluations/results/."""
    results = ROOT / "evaluations" / "results"
    assert rc.main(["--here", "--only", "^no command matches this$"]) == 0
    out = capsys.readouterr().out
    where = Path(re.search(r"^report and log: (.+)$", out, flags=re.M).group(1))
    assert where.is_relative_to(tempfile.gettempdir())
    assert {p.suffix for p in where.iterdir()} == {".md", ".json", ".log"}
    assert "0 ok, 0 failed" in out and "not selected" in out
    assert not list(results.glob("readme_commands_*"))
    shutil.rmtree(where)
