"""Run every benchmark module in its own process and rewrite BENCHMARKS.md.

Usage::

    python -m benchmarks                 # all modules
    python -m benchmarks bench_layout    # some modules (BENCHMARKS.md keeps the other rows)

Each ``benchmarks/bench_*.py`` defines ``run() -> list[dict]`` with keys ``name``,
``value``, ``unit``, ``target`` (text), ``ok`` (bool or None: no target) and ``notes``.
A module runs in a fresh interpreter with 8 simulated CPU devices so one benchmark's JAX
state (device count, caches) never leaks into another.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results.json"


def _modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem_s = f"{mem / 1024**2:.0f} GiB"
    except (OSError, AttributeError):
        mem_s = "?"
    import jax  # noqa: PLC0415 - only for the version

    return (f"{cpu}, {os.cpu_count()} cores, {mem_s} RAM, Python {platform.python_version()}, "
            f"JAX {jax.__version__}, 8 simulated CPU devices")


def _run_one(name: str) -> list[dict]:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--one", name], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    took = time.perf_counter() - t0
    measured = {"machine": _machine(), "when": _now()}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return [{"name": f"{name} (failed)", "value": None, "unit": "", "target": "",
                 "ok": False, "notes": " / ".join(tail)[-400:], "module": name,
                 "measured": measured}]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in rows:
        r["module"] = name
        r.setdefault("measured", measured)   # a row a module keeps from an earlier run
    print(f"{name}: {len(rows)} result(s) in {took:.0f} s", file=sys.stderr)
    return rows


def _fmt(v: object) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _provenance(rows: list[dict]) -> list[str]:
    """One line per module: the machine and times its rows were measured (a run of some
    modules keeps the others' rows, so one machine line for the whole file would be wrong
    for them; a module may keep rows of its own from an earlier run); rows recorded by
    hand from an accelerator say so in their notes."""
    by_mod: dict[str, list[dict | None]] = {}
    for r in rows:
        if not r.get("accelerator"):
            m = r.get("measured")
            by_mod.setdefault(r.get("module", ""), []).append(m if isinstance(m, dict) else None)
    lines = []
    for mod, ms in by_mod.items():
        known = [m for m in ms if m]
        if not known:
            lines.append(f"- {mod}: not recorded (measured before rows kept their machine).")
            continue
        machines = ", ".join(dict.fromkeys(m["machine"] for m in known))
        whens = sorted({m["when"] for m in known})
        lines.append(f"- {mod}: {machines}, {whens[-1]}"
                     + (f" (some rows {', '.join(whens[:-1])})" if len(whens) > 1 else "")
                     + "." + ("" if len(known) == len(ms) else " Some rows not recorded."))
    return lines


def _write(rows: list[dict]) -> None:
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m benchmarks`); do not edit by hand.",
        f"Written: {_now()}, on {_machine()}. Where each module's rows were measured:",
        "",
        *_provenance(rows),
        "",
        "| module | what | measured | unit | target | meets | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = {True: "yes", False: "**no**", None: "—"}[r.get("ok")]
        notes = str(r.get("notes", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.get('module', '')} | {r['name']} | {_fmt(r.get('value'))} | "
                     f"{r.get('unit', '')} | {r.get('target', '')} | {ok} | {notes} |")
    OUT.write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        mod = importlib.import_module(f"benchmarks.{argv[1]}")
        rows = mod.run()
        print(json.dumps(rows, default=float))
        return 0
    wanted = argv or _modules()
    fresh = [row for name in wanted for row in _run_one(name)]
    # read after the run: another module's run that ended meanwhile keeps its rows; rows
    # measured on an accelerator (``"accelerator"``: which, recorded by hand from the
    # accelerator scripts' tables) stay until an accelerator run replaces them
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    rows = [r for r in previous if r.get("accelerator") or (argv and r.get("module") not in wanted)]
    rows += fresh
    order = {m: i for i, m in enumerate(_modules())}
    rows.sort(key=lambda r: order.get(r.get("module"), 99))
    RESULTS.write_text(json.dumps(rows, indent=1, default=float))
    _write(rows)
    print(OUT.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
