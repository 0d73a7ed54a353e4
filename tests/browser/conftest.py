"""JupyterLab + headless Chromium fixtures for the browser tests.

``lab`` starts one JupyterLab server for the session (127.0.0.1, random port, a token,
a scratch root directory) and ``lab_notebook`` opens a notebook in a fresh page, runs
every cell in the live kernel and returns the Playwright page with helpers to move
sliders and read plots. Screenshots go to ``build/screenshots/``.

Chromium is Debian's (/usr/bin/chromium); the tests skip when it or Playwright is missing,
except in CI (``CI=true``), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "build" / "screenshots"
CHROMIUM = os.environ.get("OPSNN_CHROMIUM", "/usr/bin/chromium")
NEWS_PLUGIN = "@jupyterlab/apputils-extension:announcements"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test cannot run in CI: {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen, log: Path):
        self.root, self.port, self.token, self.proc, self.log = root, port, token, proc, log

    def url(self, path: str = "lab") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def add_notebook(self, source: str | Path | None = None, cells: list[str] | None = None,
                     name: str | None = None) -> str:
        """Copy a notebook (or build one from code ``cells``) into the lab root; return its name."""
        import nbformat

        if source is not None:
            source = Path(source)
            name = name or source.name
            shutil.copy(source, self.root / name)
        else:
            nb = nbformat.v4.new_notebook()
            nb.cells = [nbformat.v4.new_code_cell(c) for c in cells or []]
            nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
            name = name or f"scratch_{secrets.token_hex(3)}.ipynb"
            nbformat.write(nb, self.root / name)
        subprocess.run([sys.executable, "-m", "jupyter", "trust", str(self.root / name)],
                       check=False, capture_output=True)
        return name


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        _missing(f"{CHROMIUM} not found (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        _missing("playwright is not installed (pip install opsnn-lab[dev])")
    root = tmp_path_factory.mktemp("lab")
    port, token = _free_port(), secrets.token_hex(16)
    log = root.parent / "jupyterlab.log"
    config_dir = root.parent / "jupyter_config"
    # No "get notified about official Jupyter news?" toast over the widgets in every screenshot: the Lab
    # these tests start never loads the plugin that asks (nor fetches any news).
    (config_dir / "labconfig").mkdir(parents=True, exist_ok=True)
    (config_dir / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {NEWS_PLUGIN: True}}))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
           "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=root)
    server = Lab(root, port, token, proc, log)
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url("api/status"), timeout=2) as r:
                json.load(r)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.terminate()
        pytest.fail(f"JupyterLab did not start in 90 s:\n{log.read_text()[-3000:]}")
    yield server
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class NotebookPage:
    """A notebook open in JupyterLab with all its cells run."""

    def __init__(self, page, lab: Lab, name: str):
        self.page, self.lab, self.name = page, lab, name

    def run_all(self, timeout_s: float = 240) -> None:
        page = self.page
        page.wait_for_function("(name) => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.context"
                               " && window.jupyterapp.shell.currentWidget.context.path.endsWith(name)"
                               " && window.jupyterapp.shell.currentWidget.sessionContext"
                               " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                               " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                               arg=self.name, timeout=90_000)
        page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext"
                               ".session.kernel.status === 'idle'", timeout=90_000)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        # Run-all is done when no cell shows the busy marker "[*]" and the kernel is idle.
        page.wait_for_function(
            """() => {
                const nb = window.jupyterapp.shell.currentWidget;
                const busy = [...document.querySelectorAll('.jp-InputPrompt')]
                    .some(e => e.textContent.includes('*'));
                return !busy && nb.sessionContext.session.kernel.status === 'idle';
            }""", timeout=timeout_s * 1000, polling=500)
        errors = self.page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
        assert not tracebacks, f"{self.name} raised in the browser:\n" + "\n".join(tracebacks)[-3000:]

    def screenshot(self, stem: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{stem}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def plot_paths(self, index: int = 0) -> list[str]:
        """The SVG ``d`` attributes of every line trace in the index-th plotly plot on the page."""
        plot = self.page.locator(".js-plotly-plot").nth(index)
        return plot.locator(".scatterlayer path.js-line").evaluate_all("els => els.map(e => e.getAttribute('d'))")

    def set_slider(self, index: int, value) -> None:
        """Type ``value`` into the index-th ipywidgets slider's readout, as a user would."""
        readout = self.page.locator(".widget-slider .widget-readout").nth(index)
        readout.click()
        self.page.keyboard.press("Control+A")
        self.page.keyboard.type(str(value))
        self.page.keyboard.press("Enter")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def lab_notebook(lab, browser, request):
    """``open(name_or_path=None, cells=None) -> NotebookPage`` with all cells run.

    A failing test leaves a screenshot of each page it opened in ``build/screenshots/``.
    """
    pages = []
    opened: list[NotebookPage] = []

    def open_(source: str | Path | None = None, cells: list[str] | None = None, run: bool = True,
              timeout_s: float = 240) -> NotebookPage:
        name = lab.add_notebook(source, cells)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        pages.append(context)
        # A workspace of its own per page: JupyterLab otherwise restores the tabs earlier tests opened,
        # and "run all" could land on one of those instead of this notebook.
        workspace = f"t{secrets.token_hex(4)}"
        page.goto(lab.url(f"lab/workspaces/{workspace}/tree/{name}"), wait_until="domcontentloaded", timeout=90_000)
        page.wait_for_selector(".jp-Notebook", timeout=90_000)
        nb = NotebookPage(page, lab, name)
        opened.append(nb)
        if run:
            nb.run_all(timeout_s)
        return nb

    yield open_
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for i, nb in enumerate(opened):
            nb.screenshot(f"FAILED_{request.node.name}_{i}")
    for nb in opened:  # shut the kernel down: a kernel left running holds a CPU the next test needs
        nb.page.evaluate("() => window.jupyterapp.shell.currentWidget?.sessionContext?.shutdown()")
    for context in pages:
        context.close()
