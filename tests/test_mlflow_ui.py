"""The links the quick start and a sweep print, opened in a fresh headless browser against
`mlflow ui`: they land on the runs table in the model-training view with the headline
columns shown, the sweep's on its points grouped under it, and its chart renders.

Screenshots are saved into the test's temporary folder (`--basetemp` keeps them).
"""
import re

import pytest
from conftest import launch, serving_mlflow
from test_quiet_output import foreign_lines


pytestmark = pytest.mark.slow  # trains, serves MLflow and drives a browser

HEADLINE_HEADERS = {"tok_s_gpu", "step_ms", "peak_mem_gib", "final_loss", "gridwright.layout", "gridwright.engine",
                    "zero.stage"}
GENAI_ONLY = ("Judges", "Detect Issues", "Sessions")  # what the GenAI view's side bar and overview show


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api")
    from browser import NoBrowser, launch as launch_browser

    with playwright_api.sync_playwright() as p:
        try:
            chromium = launch_browser(p)
        except NoBrowser as e:
            pytest.skip(str(e))
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The quick start and a two-point traced sweep, run from one folder into its local store
    (their terminal output holds no upstream noise), and `mlflow ui` serving that store. Yields (UI address, quick start's output, sweep's output)."""
    tmp = tmp_path_factory.mktemp("ui")
    quick = launch([], cwd=tmp, timeout=600)
    assert quick.returncode == 0, quick.stderr[-3000:]
    # The README's traced sweep, with an empty matplotlib cache: its first plot builds it,
    # as on a fresh machine.
    sweep = launch(["-m", "parallel.tp=1,2", "evaluate.profile_steps=[1,3]", "train.steps=3"], cwd=tmp, timeout=900,
                   MPLCONFIGDIR=str(tmp / "matplotlib"))
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert (tmp / "matplotlib").is_dir()
    # What a user's terminal shows: gridwright's lines only, no upstream noise.
    for output in (quick, sweep):
        assert foreign_lines(output.stdout + output.stderr) == []
    with serving_mlflow(f"sqlite:///{tmp / 'mlflow.db'}", tmp, command="ui") as base:
        yield base, quick.stdout, sweep.stdout


def printed_link(output: str, label: str, base: str) -> str:
    """The last `label: URL` line of a command's output, pointed at the test's UI port (the
    printed one is `mlflow ui`'s default address)."""
    links = re.findall(rf"^\s+{label}: (\S+)$", output, flags=re.M)
    assert links, f"no '{label}:' link in:\n{output[-2000:]}"
    assert links[-1].startswith("http://127.0.0.1:5000/#/")
    return links[-1].replace("http://127.0.0.1:5000", base)


def open_fresh(browser, url: str):
    """A page in a new context: no localStorage, as a first visit."""
    context = browser.new_context(viewport={"width": 1600, "height": 900})
    page = context.new_page()
    page.goto(url)
    return context, page


def visible_headers(page) -> set[str]:
    page.get_by_role("columnheader", name="tok_s_gpu").first.wait_for(timeout=90_000)
    return {h.strip() for h in page.get_by_role("columnheader").all_inner_texts() if h.strip()}


def assert_model_training_runs_view(page) -> None:
    assert "/runs?" in page.url and "overview" not in page.url, page.url  # not redirected to the GenAI overview
    page.get_by_role("heading", name="Runs").first.wait_for(timeout=30_000)
    for text in GENAI_ONLY:
        assert page.get_by_text(text, exact=True).count() == 0, f"GenAI view: {text!r} is shown"


def check_runs_table(browser, url: str, names: list[str], shot) -> object:
    """Open a `compare:` link fresh: the model-training runs table with the headline columns
    and the named runs as rows; a screenshot at `shot`. Returns the page's context (open)."""
    context, page = open_fresh(browser, url)
    headers = visible_headers(page)
    assert HEADLINE_HEADERS <= headers, headers
    assert_model_training_runs_view(page)
    for name in names:
        page.get_by_role("link", name=name, exact=True).wait_for(timeout=30_000)
    page.screenshot(path=str(shot))
    return context, page


def test_quick_start_link_opens_the_runs_table_with_headline_columns(store, browser, tmp_path):
    base, quick, _ = store
    context, _ = check_runs_table(browser, printed_link(quick, "compare", base), ["tiny_llama dp2"],
                                  tmp_path / "quick_start_runs_table.png")
    context.close()
    context, page = open_fresh(browser, printed_link(quick, "this run", base))
    try:
        page.get_by_text("tiny_llama dp2", exact=True).first.wait_for(timeout=60_000)
        for text in GENAI_ONLY:
            assert page.get_by_text(text, exact=True).count() == 0, f"GenAI view: {text!r} is shown"
        page.screenshot(path=str(tmp_path / "quick_start_run_page.png"))
    finally:
        context.close()


def test_sweep_link_shows_its_points_and_the_parents_chart(store, browser, tmp_path):
    base, _, sweep = store
    # Both points are rows, grouped under the sweep and unfolded; the quick start's run, which
    # took the plain name first, is not.
    context, page = check_runs_table(browser, printed_link(sweep, "compare", base),
                                     ["tiny_llama dp2 #2", "tiny_llama tp2-dp1"], tmp_path / "sweep_runs_table.png")
    try:
        assert page.get_by_role("link", name="tiny_llama dp2", exact=True).count() == 0
        # the group's own row shows values its points measured (their largest), not averages
        # across layouts, which measure nothing and print with every digit
        cells = [c.strip() for c in page.get_by_role("gridcell").all_inner_texts()]
        aggregated = [c for c in cells if c.endswith(")") and " (" in c]
        assert aggregated and all(c.endswith(" (max)") for c in aggregated), aggregated
        assert {c.removesuffix(" (max)") for c in aggregated} <= set(cells), cells
    finally:
        context.close()
    context, page = open_fresh(browser, printed_link(sweep, "chart", base))
    try:
        page.get_by_text("points.png").first.wait_for(timeout=60_000)  # the artifact opened in the viewer
        image = page.locator("img[src^='blob:']").first  # the viewer shows the file it fetched
        image.wait_for(timeout=60_000)
        page.wait_for_function("img => img.complete && img.naturalWidth > 400", arg=image.element_handle())
        page.screenshot(path=str(tmp_path / "sweep_chart.png"))
    finally:
        context.close()
