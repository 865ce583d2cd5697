"""The README's own commands, run as a user runs them.

``make lab`` starts JupyterLab on notebooks/ for whoever runs it: as root (where
jupyter_server refuses to start without ``--allow-root``; these tests run as root here) and
as an unprivileged user. Each run is headless (``LAB_ARGS`` with ``--no-browser``, a free
port, a token), opens the lab page in Debian's headless Chromium, runs the Workbench side
panel's command from the command palette, then stops ``make`` with Ctrl-C (SIGINT to its
process group) and checks that the port is free and no process of it is left.

``python -m workbench train|launch|ping|runs --help`` (the entry points the README names)
each exit 0 with their usage, from the venv's python in a fresh process.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import pathlib
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from jupyterlab_harness import Lab, act_until_visible, free_port, wait_ready

REPO = pathlib.Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
OPEN_RUNS = "workbench:open-runs"  # CommandIDs.openRuns in labextension/src/tokens.ts
ROOT_NOTE = "make lab: running as root, so passing --allow-root"
STARTUP_S = 180  # 2 shared CPU cores, other tests beside this one
STOP_S = 60


# --- python -m workbench: the entry points the README names ------------------------------

@pytest.mark.parametrize("command", ["train", "launch", "ping", "runs"])
def test_workbench_command_help(command: str, tmp_path: pathlib.Path) -> None:
    if not VENV_PYTHON.exists():
        pytest.skip(f"{VENV_PYTHON} is missing; `make install` creates it")
    assert f"python -m workbench {command}" in (REPO / "README.md").read_text(), \
        f"the README no longer names `python -m workbench {command}`"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(VENV_PYTHON), "-m", "workbench", command, "--help"],
                         cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: workbench {command}"), out.stdout
    assert "options:" in out.stdout and "--help" in out.stdout, out.stdout


# --- bytecode ------------------------------------------------------------------------------

def test_only_make_lab_byte_compiles_and_only_where_python_would_not():
    """pip installs without byte-compiling (the tests write the bytecode of what they
    import). ``make lab`` byte-compiles the venv's packages once first exactly where the
    environment sets PYTHONDONTWRITEBYTECODE (kernels would then never write it); the test
    set-up never does. Read from make's own dry run of each command."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("`make` is not installed")

    def dry_run(target: str, **env: str) -> str:
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        out = subprocess.run([make, "-n", "-B", target], cwd=REPO, env={**base, **env},
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    set_up = dry_run("install", PYTHONDONTWRITEBYTECODE="1")   # -B: every step, as fresh
    pip_deps = [ln for ln in set_up.splitlines() if "pip install" in ln and "-r" in ln]
    assert pip_deps and all("--no-compile" in ln for ln in pip_deps), set_up
    assert "compileall" not in set_up
    lab = dry_run("lab", PYTHONDONTWRITEBYTECODE="1")
    assert "-m compileall" in lab and "purelib" in lab and lab.index("compileall") < \
        lab.index("jupyter lab"), lab
    assert "compileall" not in dry_run("lab")
    assert "compileall" not in dry_run("test", PYTHONDONTWRITEBYTECODE="1")


# --- make lab ------------------------------------------------------------------------------

def _session_pids(sid: int) -> dict[int, str]:
    """Live processes of session ``sid``: pid -> command line."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        found[int(entry.name)] = cmd.strip()
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _require_make_and_venv() -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("`make` is not installed")
    if not VENV_PYTHON.exists():
        pytest.skip(f"{VENV_PYTHON} is missing; `make install` creates it")
    stale = subprocess.run([make, "-q", "install"], cwd=REPO, stdin=subprocess.DEVNULL,
                           capture_output=True, check=False)
    if stale.returncode != 0:
        # `make lab` would reinstall first (minutes, and into the venv other tests use).
        pytest.skip(".venv is older than pyproject.toml or labextension/; `make install` "
                    "(which `make test` runs first) brings it up to date")
    return make


def _unprivileged(workdir: pathlib.Path) -> tuple[list[str], str]:
    """The command prefix that runs a command as ``nobody``, and how it does so.

    ``runuser -u nobody`` when nobody can run the venv; where the venv's interpreter lies
    in a directory nobody cannot enter (a pyenv Python under a mode-700 /root, as here),
    ``setpriv`` as nobody with only CAP_DAC_READ_SEARCH (read any file, nothing else): still
    not root, which is what decides whether ``make lab`` passes ``--allow-root``.
    Skips with the reasons when neither can run the venv.
    """
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root; this run is not root")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no `nobody` user")
    probe = ["sh", "-c", f"test -r Makefile && test -r notebooks && test -x notebooks && "
                         f"cd {workdir} && {VENV_PYTHON} -c 'import jupyterlab, workbench'"]
    tried = []
    ways = [("runuser -u nobody", ["runuser", "-u", "nobody", "--"]),
            ("setpriv as nobody with CAP_DAC_READ_SEARCH only",
             ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
              "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search",
              "--bounding-set=-all,+dac_read_search", "--"])]
    for how, prefix in ways:
        if shutil.which(prefix[0]) is None:
            tried.append(f"{how}: `{prefix[0]}` is not installed")
            continue
        out = subprocess.run([*prefix, *probe], cwd=REPO, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=120, check=False)
        if out.returncode == 0:
            return prefix, how
        tried.append(f"{how}: cannot read the repository or run {VENV_PYTHON} "
                     f"({(out.stderr.strip() or f'exit {out.returncode}').splitlines()[-1]})")
    pytest.skip("no unprivileged user can run make lab here: " + "; ".join(tried))


@contextlib.contextmanager
def _make_lab(make: str, prefix: list[str], state: pathlib.Path) -> Iterator[Lab]:
    """``make lab LAB_ARGS="--no-browser --port=P --ip=127.0.0.1 ..."`` in its own session;
    Jupyter's runtime files, settings, workspaces and config go to ``state``."""
    port, token = free_port(), secrets.token_hex(16)
    lab_args = (f"--no-browser --port={port} --ip=127.0.0.1 --ServerApp.port_retries=0 "
                f"--IdentityProvider.token={token}")
    env = [f"HOME={state}", f"JUPYTER_RUNTIME_DIR={state / 'runtime'}",
           f"JUPYTER_CONFIG_DIR={state / 'config'}",
           f"JUPYTERLAB_SETTINGS_DIR={state / 'settings'}",
           f"JUPYTERLAB_WORKSPACES_DIR={state / 'workspaces'}"]
    log_path = state.parent / "make-lab.log"
    cmd = [*prefix, "env", *env, make, "lab", f"LAB_ARGS={lab_args}"]
    with open(log_path, "wb") as log:
        # A terminal's Ctrl-C must reach make and jupyter even where this test itself runs
        # with SIGINT ignored (a background job), so the child starts with the default.
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lab = Lab(url=f"http://127.0.0.1:{port}", token=token, port=port,
              root_dir=REPO / "notebooks", log_path=log_path, process=proc)
    try:
        yield lab
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in _session_pids(proc.pid):  # what this test started, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _run_from_the_palette(page: Any, label: str, command: str) -> None:
    """Runs ``command`` as a user does: Ctrl+Shift+C opens the modal command palette, the
    query is its label, Enter runs the active item (the best match). Not item.click(): on
    a loaded machine the palette re-renders its items while JupyterLab is still starting,
    and a click waiting for a stable element ran out its 30 s (a clean-clone CI run).

    Each step waits a few seconds for what it should show and starts over while it does
    not: a shortcut pressed before JupyterLab bound it does nothing, a press after the
    palette opened closes it, and a widget the restored layout focuses closes the palette
    (it hides when it loses focus) with the query typed: a pinned, loaded clean-clone run
    pressed once and waited 30 s for a palette, another filled it once and waited 30 s for
    an active item."""
    search = page.locator(".jp-ModalCommandPalette input")
    active = page.locator(f".lm-CommandPalette-item.lm-mod-active[data-command='{command}']")

    def ask() -> None:
        if not search.is_visible():
            page.locator("#jp-main-dock-panel").click()
            page.keyboard.press("Control+Shift+C")
            search.wait_for(state="visible", timeout=3_000)
        search.fill(label, timeout=3_000)

    act_until_visible(active, ask)
    assert label in active.inner_text()
    search.press("Enter")


def _check_lab_page(lab: Lab, browser) -> None:
    """The lab page loads in Chromium and the palette runs the Workbench panel's command."""
    page = browser.new_page()
    try:
        page.goto(f"{lab.url}/lab?token={lab.token}", timeout=STARTUP_S * 1000)
        page.wait_for_selector("#jp-main-dock-panel", timeout=STARTUP_S * 1000)
        page.wait_for_selector(".jp-SideBar .lm-TabBar-tab[data-id='workbench-runs']",
                               timeout=60_000)
        # JupyterLab 4.6 does not expose window.jupyterapp unless told; the command palette
        # lists every registered command, as a user sees it.
        panel = page.locator("#workbench-runs")
        act_until_visible(panel, lambda: _run_from_the_palette(page, "Workbench: Show Runs",
                                                               OPEN_RUNS))
    finally:
        page.close()


def _stop_and_check(lab: Lab) -> None:
    """Ctrl-C to the make process group: make, jupyter and all else of it exit, port free."""
    proc = lab.process
    running = _session_pids(proc.pid)
    assert any(re.search(r"jupyter[- ]lab ", cmd) for cmd in running.values()), running
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"make lab still runs {STOP_S} s after Ctrl-C:\n{lab.log_tail()}")
    deadline = time.monotonic() + 15
    while (left := _session_pids(proc.pid)) or not _port_free(lab.port):
        if time.monotonic() > deadline:
            pytest.fail(f"after make lab exited: processes left {left}, port {lab.port} "
                        f"free: {_port_free(lab.port)}\n{lab.log_tail()}")
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("who", ["as-root", "unprivileged"])
def test_make_lab_starts_for_whoever_runs_it(who: str, browser) -> None:
    make = _require_make_and_venv()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="wb-make-lab-"))
    state = workdir / "home"
    state.mkdir()
    try:
        if who == "as-root":
            if os.geteuid() != 0:
                pytest.skip("this run is not root (the unprivileged case covers it)")
            prefix, how = [], "root"
        else:
            workdir.chmod(0o755)  # mkdtemp's 0700 would keep nobody out
            prefix, how = _unprivileged(workdir)
            nobody = pwd.getpwnam("nobody")
            os.chown(state, nobody.pw_uid, nobody.pw_gid)  # nobody's HOME, writable
        print(f"make lab run by: {how}")
        with _make_lab(make, prefix, state) as lab:
            try:
                wait_ready(lab, STARTUP_S)
            except (RuntimeError, TimeoutError) as e:
                pytest.fail(f"make lab ({how}) did not start JupyterLab: {e}", pytrace=False)
            log = lab.log_path.read_text(errors="replace")
            notes = [ln for ln in log.splitlines() if ln.startswith(ROOT_NOTE)]
            if who == "as-root":
                assert len(notes) == 1, log  # says once, one line, why
            else:
                assert notes == [] and "--allow-root" not in log, log
            assert "Running as root is not recommended" not in log, log
            names = {c["name"] for c in lab.api("contents")["content"]}
            assert "00_tour.ipynb" in names, names  # served from notebooks/
            _check_lab_page(lab, browser)
            _stop_and_check(lab)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- installing and testing leave the checkout as they found it ---------------------------

def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def test_the_committed_lockfile_is_what_npm_resolves(tmp_path: pathlib.Path) -> None:
    """npm resolves labextension/package.json to exactly the committed lockfile, every
    platform's optional packages included: a fresh `npm install` (the build's, Binder's)
    would not rewrite it (a lockfile written on one platform once lacked 234 lines of
    other platforms' optional packages, and every fresh clone's install added them)."""
    npm = shutil.which("npm")
    if npm is None:
        if _under_ci():
            pytest.fail("npm is missing under CI; the extension's build needs Node 20",
                        pytrace=False)
        pytest.skip("npm is not installed (the extension's build needs Node 20)")
    ext = REPO / "labextension"
    for name in ("package.json", "package-lock.json"):
        shutil.copy2(ext / name, tmp_path / name)
    out = subprocess.run([npm, "install", "--package-lock-only", "--ignore-scripts",
                          "--prefer-offline", "--no-audit", "--no-fund"], cwd=tmp_path,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                         check=False)
    if out.returncode != 0 and not _under_ci():
        asked = subprocess.run([npm, "view", "npm", "version"], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120, check=False)
        if asked.returncode != 0:
            pytest.skip(f"npm's registry does not answer here: {asked.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stdout + out.stderr
    want = (ext / "package-lock.json").read_text().splitlines()
    got = (tmp_path / "package-lock.json").read_text().splitlines()
    diff = "\n".join(difflib.unified_diff(want, got, "committed", "npm's", n=1, lineterm=""))
    assert got == want, (f"npm rewrites labextension/package-lock.json (run `npm install` in "
                         f"labextension/ and commit the lockfile):\n{diff[:3000]}")


def test_test_fast_leaves_out_exactly_the_heavy_markers() -> None:
    """`make test-fast`'s selection, pyproject's registered markers and the README's table
    name the same heavy markers (a marker added to one and not the others would make the
    fast subset run heavy tests, or select nothing)."""
    import tomllib

    from conftest import HEAVY_MARKERS

    fast = re.search(r"^FAST_TESTS := not \((.*)\)$", (REPO / "Makefile").read_text(), re.M)
    assert fast is not None, "the Makefile has no FAST_TESTS selection"
    assert fast.group(1).split(" or ") == list(HEAVY_MARKERS)
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
    registered = [m.split(":")[0] for m in config["ini_options"]["markers"]]
    assert registered == [*HEAVY_MARKERS, "gpu"]
    assert "--strict-markers" in config["ini_options"]["addopts"]
    readme = (REPO / "README.md").read_text()
    assert all(f"| `{m}` |" in readme for m in registered)
    assert f'-m "not ({" or ".join(HEAVY_MARKERS)})"' in readme
