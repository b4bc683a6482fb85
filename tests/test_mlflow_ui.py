"""The links the quick start and a sweep print, opened in a fresh headless browser against
`mlflow ui`: they land on the runs table in the model-training view with the headline
columns shown, the sweep's on its points grouped under it, and its chart renders.

Screenshots are saved into the test's temporary folder (`--basetemp` keeps them).
"""
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import launch

from gridwright.runtime.loopback import free_port

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
    """The quick start and a two-point sweep, run from one folder into its local store, and
    `mlflow ui` serving that store. Yields (folder, UI address, quick start's output,
    sweep's output)."""
    tmp = tmp_path_factory.mktemp("ui")
    quick = launch([], cwd=tmp, timeout=600)
    assert quick.returncode == 0, quick.stderr[-3000:]
    sweep = launch(["-m", "parallel.tp=1,2", "train.steps=3"], cwd=tmp, timeout=900)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                os.killpg(server.pid, signal.SIGKILL)
                pytest.fail("mlflow ui did not come up")
            time.sleep(1)
    yield tmp, base, quick.stdout, sweep.stdout
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


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


def test_quick_start_link_opens_the_runs_table_with_headline_columns(store, browser, tmp_path):
    tmp, base, quick, _ = store
    context, page = open_fresh(browser, printed_link(quick, "compare", base))
    try:
        headers = visible_headers(page)
        assert HEADLINE_HEADERS <= headers, headers
        assert_model_training_runs_view(page)
        assert page.get_by_role("link", name="tiny_llama dp2", exact=True).count() == 1  # the quick start's run
        page.screenshot(path=str(tmp_path / "quick_start_runs_table.png"))
    finally:
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
    tmp, base, _, sweep = store
    context, page = open_fresh(browser, printed_link(sweep, "compare", base))
    try:
        headers = visible_headers(page)
        assert HEADLINE_HEADERS <= headers, headers
        assert_model_training_runs_view(page)
        # Both points are visible rows (the quick start's run took the plain name first).
        for name in ("tiny_llama dp2 #2", "tiny_llama tp2-dp1"):
            page.get_by_role("link", name=name, exact=True).wait_for(timeout=30_000)
        assert page.get_by_role("link", name="tiny_llama dp2", exact=True).count() == 0  # not this sweep's
        page.screenshot(path=str(tmp_path / "sweep_runs_table.png"))
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
