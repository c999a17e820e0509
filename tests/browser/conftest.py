"""Real-browser fixtures: JupyterLab (and marimo) on 127.0.0.1, driven by Playwright with
the system's Chromium.

Playwright cannot download its own browsers here, so it launches Debian's ``chromium``
(``apt-get install chromium``; ``scripts/test.sh`` installs it). Override the binary with
``VRAMWIDGET_CHROMIUM=/path/to/chrome``.

In CI (``CI=true``) a missing browser, a missing Python package or a server that does
not start FAILS the test. Locally these tests are skipped, with the reason.

Every server listens on 127.0.0.1 only, on a free port, with a random token. It gets its
own temporary config, data, runtime, settings and workspace folders, so nothing leaks
from (or into) the user's Jupyter setup. Each server is stopped when its fixture ends.
Every page records the URL of each request it makes. A request for anything other
than loopback is aborted, and the JupyterLab tests assert that none was made.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-default-apps", "--disable-extensions", "--mute-audio",
]
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
LOCAL_SCHEMES = {"data", "blob", "about"}


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives a real browser (Chromium via Playwright)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds; still part of the default run")


def unavailable(reason: str):
    """Skip locally; fail in CI, where the browser tests must run."""
    if IN_CI:
        pytest.fail(f"browser test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def is_local(url: str) -> bool:
    """True for loopback http(s)/ws(s) URLs and for data:, blob:, about: URLs."""
    parts = urlsplit(url)
    if parts.scheme in LOCAL_SCHEMES:
        return True
    return (parts.hostname or "") in LOCAL_HOSTS


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_executable() -> Optional[str]:
    explicit = os.environ.get("VRAMWIDGET_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    for path in ("/usr/bin/chromium", "/usr/lib/chromium/chromium"):
        if os.access(path, os.X_OK):
            return path
    return None


# ---------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------

class Server:
    """A child process serving HTTP on 127.0.0.1, with its log in a file."""

    def __init__(self, name: str, cmd: List[str], env: Dict[str, str], cwd: Path, log: Path,
                 port: int, token: str):
        self.name, self.cmd, self.port, self.token, self.log_path = name, cmd, port, token, log
        self.base = f"http://127.0.0.1:{port}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_http(self, path: str, timeout: float) -> None:
        """Wait until GET path answers below 400; fail (CI) or skip (local) if it never does."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                unavailable(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with _NO_PROXY.open(self.base + path, timeout=5) as r:
                    if r.status < 400:
                        return
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.25)
        self.stop()
        unavailable(f"{self.name} did not answer on {self.base}{path} within {timeout:.0f} s "
                    f"({last}):\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server's whole process group (the server and its kernels); only ours."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._log.close()


#: loopback never goes through a proxy, whatever the environment says
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def isolated_env(home: Path) -> Dict[str, str]:
    """Environment for a server: private Jupyter/IPython folders, the checkout importable,
    no proxies, and no way to a package index from inside a test."""
    env = dict(os.environ)
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(var, None)
    dirs = {
        "JUPYTER_CONFIG_DIR": home / "config",
        "JUPYTER_DATA_DIR": home / "data",
        "JUPYTER_RUNTIME_DIR": home / "runtime",
        "JUPYTERLAB_SETTINGS_DIR": home / "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": home / "lab-workspaces",
        "IPYTHONDIR": home / "ipython",
        "MPLCONFIGDIR": home / "mpl",
        "MARIMO_CONFIG_DIR": home / "marimo-config",
        "XDG_CONFIG_HOME": home / "xdg-config",
        "XDG_CACHE_HOME": home / "xdg-cache",
        "XDG_STATE_HOME": home / "xdg-state",
    }
    for k, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        env[k] = str(d)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    # the kernel imports this checkout even where the package is not installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _lab_settings(settings_dir: Path) -> None:
    """User settings for a quiet, deterministic JupyterLab: no news or update checks
    (they would fetch from the internet), every cell rendered (no windowing), no
    autosave back into the test files, light theme."""
    _write_json(settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings",
                {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True})
    _write_json(settings_dir / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings",
                {"windowingMode": "none"})
    _write_json(settings_dir / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings",
                {"autosave": False})
    _write_json(settings_dir / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings",
                {"theme": "JupyterLab Light"})
    _write_json(settings_dir / "@jupyterlab" / "extensionmanager-extension" / "plugin.jupyterlab-settings",
                {"enabled": False})


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1: ``.base``, ``.token``, ``.root`` (its notebook
    folder, a temporary directory) and ``.url(path)``."""
    for mod in ("jupyterlab", "ipykernel", "anywidget"):
        try:
            __import__(mod)
        except ImportError:
            unavailable(f"{mod} is not installed (pip install -e '.[test]')")
    home = tmp_path_factory.mktemp("jupyter-home")
    root = tmp_path_factory.mktemp("lab-root")
    env = isolated_env(home)
    _lab_settings(Path(env["JUPYTERLAB_SETTINGS_DIR"]))
    port, token = free_port(), secrets.token_hex(16)
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.terminals_enabled=False",
        "--ServerApp.answer_yes=True",
    ]
    server = Server("jupyter lab", cmd, env, root, home / "jupyter-lab.log", port, token)
    server.root = root
    server.url = lambda path="lab": f"{server.base}/{path.lstrip('/')}" + (
        ("&" if "?" in path else "?") + f"token={token}")
    try:
        server.wait_http(f"/api/status?token={token}", timeout=120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def notebook7(tmp_path_factory):
    """A Jupyter Notebook 7 server on 127.0.0.1 (the same private folders and settings as
    the JupyterLab one): ``.base``, ``.token``, ``.root`` and ``.url(path)``."""
    for mod in ("notebook", "ipykernel", "anywidget"):
        try:
            __import__(mod)
        except ImportError:
            unavailable(f"{mod} is not installed (pip install -e '.[test]')")
    home = tmp_path_factory.mktemp("notebook-home")
    root = tmp_path_factory.mktemp("nb-root")
    env = isolated_env(home)
    _lab_settings(Path(env["JUPYTERLAB_SETTINGS_DIR"]))
    port, token = free_port(), secrets.token_hex(16)
    cmd = [
        sys.executable, "-m", "jupyter", "notebook", "--no-browser", "--allow-root",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--expose-app-in-browser",     # window.jupyterapp (Notebook 7 has no news or update check)
        "--ServerApp.terminals_enabled=False", "--ServerApp.answer_yes=True",
    ]
    server = Server("jupyter notebook", cmd, env, root, home / "jupyter-notebook.log", port, token)
    server.root = root
    server.url = lambda path="tree": f"{server.base}/{path.lstrip('/')}" + (
        ("&" if "?" in path else "?") + f"token={token}")
    try:
        server.wait_http(f"/api/status?token={token}", timeout=120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def marimo_server(tmp_path_factory):
    """``marimo run notebooks/marimo_app.py`` on 127.0.0.1 with a random access token, no
    update check, the private config folders; its theme follows the browser's colour scheme
    (``.marimo.toml``: display.theme = "system"), so a test can look at it light and dark."""
    try:
        import marimo  # noqa: F401
    except ImportError:
        unavailable("marimo is not installed (pip install -e '.[test]')")
    home = tmp_path_factory.mktemp("marimo-home")
    env = isolated_env(home)
    env["MARIMO_SKIP_UPDATE_CHECK"] = "1"
    (home / ".marimo.toml").write_text('[display]\ntheme = "system"\n')
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "marimo", "-q", "-y", "run", str(ROOT / "notebooks" / "marimo_app.py"),
           "--host", "127.0.0.1", "--port", str(port), "--headless", "--token-password", token]
    server = Server("marimo run", cmd, env, home, home / "marimo.log", port, token)
    try:
        server.wait_http("/health", timeout=120)
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------
# the browser
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def browser():
    """Headless Chromium (Debian's build) through Playwright's sync API."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[test]')")
    exe = chromium_executable()
    if not exe:
        unavailable("no Chromium found (apt-get install chromium, or set VRAMWIDGET_CHROMIUM)")
    pw = sync_playwright().start()
    try:
        try:
            b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        except Exception as e:  # noqa: BLE001 - whatever Playwright raises, say what it was
            unavailable(f"Chromium at {exe} did not start: {e}")
        yield b
        b.close()
    finally:
        pw.stop()


class Recorder:
    """Every request a page makes; requests that would leave loopback are aborted."""

    def __init__(self):
        self.urls: List[str] = []
        self.blocked: List[str] = []

    def on_request(self, request) -> None:
        self.urls.append(request.url)

    def route(self, route) -> None:
        url = route.request.url
        if is_local(url):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def external(self) -> List[str]:
        return sorted({u for u in self.urls + self.blocked if not is_local(u)})


class BrowserPage:
    """A fresh browser context and page: its request ``recorder`` and the ``console``
    errors and uncaught exceptions of the page."""

    def __init__(self, browser, viewport=(1400, 1000)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]},
                                           color_scheme="light", service_workers="block")
        self.recorder = Recorder()
        self.context.route("**/*", self.recorder.route)
        self.page = self.context.new_page()
        self.page.on("request", self.recorder.on_request)
        self.console: List[str] = []
        self.page.on("console", lambda m: self.console.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        self.page.set_default_timeout(60_000)

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# ---------------------------------------------------------------------------------------
# JupyterLab helpers
# ---------------------------------------------------------------------------------------

def write_notebook(path: Path, cells: List[str]) -> Path:
    """A minimal nbformat-4 notebook of code cells (python3 kernel)."""
    nb = {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                     "language_info": {"name": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": src} for i, src in enumerate(cells)],
    }
    path.write_text(json.dumps(nb, indent=1))
    return path


class Lab:
    """Drives one notebook in a JupyterLab page (through the app's own commands, which
    are what its menus and buttons call)."""

    def __init__(self, page, server):
        self.page, self.server = page, server

    _workspaces = 0

    def open(self, relpath: str, timeout: float = 120) -> None:
        """Open a notebook in a fresh workspace (nothing restored from earlier pages)."""
        Lab._workspaces += 1
        self.page.goto(self.server.url(f"lab/workspaces/test{Lab._workspaces}/tree/{relpath}?reset"),
                       wait_until="domcontentloaded")
        self.page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.shell.currentWidget"
            " && window.jupyterapp.shell.currentWidget.sessionContext"
            " && window.jupyterapp.shell.currentWidget.sessionContext.session"
            " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
            timeout=timeout * 1000)
        self.wait_idle(timeout)

    def wait_idle(self, timeout: float = 120) -> None:
        self.page.wait_for_function(
            "() => { const w = window.jupyterapp.shell.currentWidget;"
            " const k = w && w.sessionContext.session && w.sessionContext.session.kernel;"
            " return k && k.status === 'idle' && k.connectionStatus === 'connected'; }",
            timeout=timeout * 1000)

    @property
    def panel(self):
        """A locator for the notebook panel in front."""
        pid = self.page.evaluate("() => window.jupyterapp.shell.currentWidget.id")
        return self.page.locator(f"[id='{pid}']")

    def hide_side_panels(self) -> None:
        """Collapse the file browser (more room for the notebook, e.g. for screenshots)."""
        self.page.evaluate("() => { const s = window.jupyterapp.shell; if (!s.leftCollapsed) s.collapseLeft(); }")

    def scroll_to_top(self, locator) -> None:
        """Scroll the notebook so that the element's top is at the top of the panel."""
        locator.evaluate("el => el.scrollIntoView({block: 'start'})")

    def command(self, name: str, args: Optional[dict] = None) -> None:
        self.page.evaluate("([n, a]) => window.jupyterapp.commands.execute(n, a || {})", [name, args])

    def run_all(self, timeout: float = 300) -> None:
        """Run every cell and wait until each has run (an execution count) and the kernel is idle."""
        self.command("notebook:run-all-cells")
        self.wait_all_ran(timeout)

    def wait_all_ran(self, timeout: float = 300) -> None:
        self.page.wait_for_function(
            "() => { const nb = window.jupyterapp.shell.currentWidget.content;"
            " const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
            " if (!k || k.status !== 'idle') return false;"
            " return nb.widgets.every(c => c.model.type !== 'code' || c.model.executionCount !== null"
            "   || c.model.sharedModel.getSource().trim() === ''); }",
            timeout=timeout * 1000, polling=250)

    def errors(self) -> List[str]:
        """The error outputs of every cell (ename: evalue)."""
        return self.page.evaluate(
            "() => { const out = []; const nb = window.jupyterapp.shell.currentWidget.content;"
            " for (const c of nb.widgets) { if (c.model.type !== 'code') continue;"
            "   const o = c.model.outputs; for (let i = 0; i < o.length; i++) { const j = o.get(i).toJSON();"
            "     if (j.output_type === 'error') out.push(j.ename + ': ' + j.evalue); } }"
            " return out; }")

    def run_new_cell(self, source: str, timeout: float = 60) -> str:
        """Append a code cell at the end, run it, return its text output."""
        n = self.page.evaluate("() => window.jupyterapp.shell.currentWidget.content.widgets.length")
        self.page.evaluate(
            "(n) => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = n - 1; }", n)
        self.command("notebook:insert-cell-below")
        self.page.wait_for_function(
            "(n) => window.jupyterapp.shell.currentWidget.content.widgets.length === n + 1", arg=n)
        self.page.evaluate(
            "(src) => { const nb = window.jupyterapp.shell.currentWidget.content;"
            " nb.activeCell.model.sharedModel.setSource(src); }", source)
        self.command("notebook:run-cell")
        self.page.wait_for_function(
            "(n) => { const c = window.jupyterapp.shell.currentWidget.content.widgets[n];"
            " return c.model.executionCount !== null && c.model.outputs.length > 0; }",
            arg=n, timeout=timeout * 1000)
        self.wait_idle(timeout)
        return self.page.evaluate(
            "(n) => { const c = window.jupyterapp.shell.currentWidget.content.widgets[n]; const o = c.model.outputs;"
            " let s = ''; for (let i = 0; i < o.length; i++) { const j = o.get(i).toJSON();"
            "   if (j.output_type === 'stream') s += Array.isArray(j.text) ? j.text.join('') : j.text;"
            "   else if (j.output_type === 'error') s += 'ERROR ' + j.ename + ': ' + j.evalue + '\\n';"
            "   else if (j.data && j.data['text/plain']) s += [].concat(j.data['text/plain']).join('') + '\\n'; }"
            " return s; }", n)


class Notebook7(Lab):
    """Drives one notebook in a Notebook 7 page (the same JupyterLab application object)."""

    def open(self, relpath: str, timeout: float = 120) -> None:
        self.page.goto(self.server.url(f"notebooks/{relpath}"), wait_until="domcontentloaded")
        self.page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.shell.currentWidget"
            " && window.jupyterapp.shell.currentWidget.sessionContext"
            " && window.jupyterapp.shell.currentWidget.sessionContext.session"
            " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
            timeout=timeout * 1000)
        self.wait_idle(timeout)


# ---------------------------------------------------------------------------------------
# chart helpers (Vega draws rect marks as SVG paths inside g.mark-rect)
# ---------------------------------------------------------------------------------------

CHART_SHAPES_JS = """
(root) => {
  const out = [];
  for (const g of root.querySelectorAll('svg g.mark-rect')) {
    for (const el of g.querySelectorAll('path, rect')) {
      const b = el.getBBox();
      if (b.width > 0 && b.height > 0)
        out.push({x: b.x, y: b.y, w: b.width, h: b.height, fill: el.getAttribute('fill') || ''});
    }
  }
  return out;
}
"""

CHART_LABELS_JS = "(root) => [...root.querySelectorAll('svg g.mark-text text')].map(t => t.textContent)"


def chart_shapes(locator) -> List[dict]:
    """The rectangles a Vega chart drew (rect marks), with their boxes in SVG units."""
    return locator.evaluate(CHART_SHAPES_JS)


def chart_labels(locator) -> List[str]:
    return locator.evaluate(CHART_LABELS_JS)


def filled_area(shapes: List[dict]) -> float:
    """Sum of the areas of the filled rectangles (component outlines have fill none)."""
    return sum(s["w"] * s["h"] for s in shapes if s["fill"] not in ("", "none", "transparent"))
