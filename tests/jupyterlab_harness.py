"""Real JupyterLab in headless Chromium for browser tests (shared by the widget and lab tests).

    from jupyterlab_harness import run_notebook, screenshot

    def test_demo(lab, browser):            # conftest: the session's one lab and Chromium
        page = browser.new_page()
        run_notebook(page, lab, lab.root_dir / "demo.ipynb", timeout=120)
        screenshot(page, "demo")            # artifacts/screenshots/demo.png

``start_lab`` and ``chromium`` start others, for a test about starting them. Chromium is
Debian's package (``make browser``); Playwright never downloads a browser.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCREENSHOTS = REPO / "artifacts" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    """Debian's chromium, if installed."""
    found = shutil.which("chromium") or "/usr/bin/chromium"
    return found if os.path.exists(found) else None


def require_chromium() -> None:
    """Skip the calling test without chromium, with the reason; under CI, fail instead."""
    if chromium_path() is not None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail("chromium is missing under CI; install it with `make browser` "
                    "(Debian's chromium package)", pytrace=False)
    pytest.skip("chromium is not installed; `make browser` installs Debian's chromium")


@dataclasses.dataclass
class Lab:
    """A running JupyterLab server."""

    url: str
    token: str
    port: int
    root_dir: pathlib.Path
    log_path: pathlib.Path
    process: subprocess.Popen

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def api(self, path: str, method: str = "GET") -> Any:
        """``/api/<path>`` with the token (``path`` may start with ``lab/api/`` for
        JupyterLab's own API); decoded JSON, or None for an empty answer."""
        url = f"{self.url}/{path}" if path.startswith("lab/") else f"{self.url}/api/{path}"
        req = urllib.request.Request(url, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a server a test starts by other means than start_lab."""
    return _free_port()


@contextlib.contextmanager
def start_lab(root_dir: str | os.PathLike, *, env: dict[str, str] | None = None,
              extra_args: Sequence[str] = (), startup_timeout: float = 90) -> Iterator[Lab]:
    """Run ``jupyter lab`` on a free 127.0.0.1 port with a random token until the block ends.

    Settings, workspaces and runtime files go to a temporary directory, so the user's
    own JupyterLab state never leaks in. The whole process group is killed on exit;
    the server log is kept and quoted in failures.
    """
    root = pathlib.Path(root_dir).resolve()
    port, token = _free_port(), secrets.token_hex(16)
    state = pathlib.Path(tempfile.mkdtemp(prefix="wb-lab-"))
    log_path = state / "jupyterlab.log"
    # No "get notified about Jupyter news?" toast over the screenshots.
    news = state / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           f"--LabApp.workspaces_dir={state / 'workspaces'}",
           f"--LabApp.user_settings_dir={state / 'settings'}", *extra_args]
    full_env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(state / "runtime"),
                **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    lab = Lab(url=f"http://127.0.0.1:{port}", token=token, port=port, root_dir=root,
              log_path=log_path, process=proc)
    try:
        _wait_ready(lab, startup_timeout)
        yield lab
    finally:
        _stop(proc)


def reset_lab(lab: Lab) -> None:
    """Back to a fresh server's state for the next test module: every session and kernel
    shut down, every saved workspace (the restored layout) deleted. Files stay."""
    for session in lab.api("sessions"):
        lab.api(f"sessions/{session['id']}", method="DELETE")
    for kernel in lab.api("kernels"):
        lab.api(f"kernels/{kernel['id']}", method="DELETE")
    for space in lab.api("lab/api/workspaces")["workspaces"]["ids"]:
        lab.api(f"lab/api/workspaces/{space}", method="DELETE")


def _wait_ready(lab: Lab, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with code {lab.process.returncode}:\n"
                               f"{lab.log_tail()}")
        try:
            lab.api("status")
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.25)
    raise TimeoutError(f"jupyter lab did not answer /api/status within {timeout:.0f} s:\n"
                       f"{lab.log_tail()}")


def wait_ready(lab: Lab, timeout: float) -> None:
    """Return once ``lab`` answers ``/api/status``; raises (with the log tail) if its process
    exits first or ``timeout`` seconds pass. For a ``Lab`` a test started itself."""
    _wait_ready(lab, timeout)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the server and its kernels (same session)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Playwright ``Browser`` on Debian's chromium (never a downloaded one)."""
    from playwright.sync_api import sync_playwright

    path = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


_PROMPTS_JS = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')).map(e => e.textContent.trim())"""


def run_notebook(page: Any, lab: Lab, nb_path: str | os.PathLike, timeout: float = 120, *,
                 check_errors: bool = True, frontend: str = "lab") -> None:
    """Open ``nb_path`` in JupyterLab, run all cells, and return once the kernel is idle.

    ``frontend="notebook"`` opens it in Notebook 7 instead (served by the same server:
    the ``notebook`` package's server extension), whose menus and cells are JupyterLab's.

    Waits until every code cell shows an execution count (``[n]:``, none ``[*]:``) and
    the server reports the notebook's kernel idle. With ``check_errors``, raises if a
    cell's output holds a traceback (its text is in the message).
    """
    rel = pathlib.Path(nb_path).resolve().relative_to(lab.root_dir).as_posix()
    where = {"lab": "lab/tree", "notebook": "notebooks"}[frontend]
    page.goto(f"{lab.url}/{where}/{rel}?token={lab.token}", timeout=timeout * 1000)
    # the notebook opened, not one a restored layout keeps in a hidden tab
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell",
                           timeout=timeout * 1000)
    _wait_kernel(lab, rel, "idle", time.monotonic() + timeout)
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    deadline = time.monotonic() + timeout
    while True:
        prompts = page.evaluate(_PROMPTS_JS)
        if prompts and all(p.startswith("[") and p[1:-2].strip().isdigit() for p in prompts):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rel}: cells still pending after {timeout:.0f} s: {prompts}\n"
                               f"{lab.log_tail(30)}")
        page.wait_for_timeout(250)
    _wait_kernel(lab, rel, "idle", deadline)
    if check_errors:
        errors = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) "
                              ".jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']")
        tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t]
        if tracebacks:
            raise AssertionError(f"{rel} raised in a cell:\n" + "\n---\n".join(tracebacks))


def _wait_kernel(lab: Lab, rel: str, want: str, deadline: float) -> None:
    state = None
    while time.monotonic() < deadline:
        sessions = [s for s in lab.api("sessions") if s.get("path") == rel]
        state = sessions[0]["kernel"]["execution_state"] if sessions and sessions[0].get("kernel") else None
        if state == want:
            return
        time.sleep(0.25)
    raise TimeoutError(f"{rel}: kernel is {state!r}, not {want!r}\n{lab.log_tail(30)}")


def act_until_visible(target: Any, act: Any, timeout: float = 60) -> Any:
    """Calls ``act()`` and waits a few seconds for the locator ``target`` to show, again
    and again until it does (then returns it) or ``timeout`` seconds passed (raises
    Playwright's TimeoutError). For what a user opens with a click or a key while
    JupyterLab may still be starting: a shortcut pressed before its keybinding exists does
    nothing, and a restored layout may open or close a panel after the test looked. A
    Playwright timeout inside ``act`` (a short wait of its own) counts as not shown yet."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.monotonic() + timeout
    while True:
        try:
            act()
            target.wait_for(state="visible", timeout=3_000)
            return target
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                raise


def show_runs_panel(page: Any, timeout: float = 60) -> Any:
    """Opens the Workbench runs side panel and returns it.

    A click on the panel's tab toggles it, and JupyterLab may still be restoring its saved
    layout when the tab appears: a restore that opens the panel after this looked at the
    tab turns a click into a close (a clean-clone CI run: the panel stayed hidden). So it
    clicks only while the tab is not the current one, and looks again until the panel
    shows."""
    tab = page.locator(".jp-SideBar .lm-TabBar-tab[data-id='workbench-runs']")
    tab.wait_for(timeout=timeout * 1000)

    def open_tab() -> None:
        if "lm-mod-current" not in (tab.get_attribute("class") or ""):
            tab.click()

    return act_until_visible(page.locator("#workbench-runs"), open_tab, timeout)


def screenshot(target: Any, name: str, *, full_page: bool = True) -> pathlib.Path:
    """Save ``artifacts/screenshots/<name>.png`` (gitignored) and return its path.

    ``target`` is a Playwright ``Page`` (the whole page) or a ``Locator`` (that element).
    """
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    if hasattr(target, "goto"):
        target.screenshot(path=str(path), full_page=full_page)
    else:
        target.screenshot(path=str(path))
    return path
