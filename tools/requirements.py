"""Prints the requirements of this project's pyproject.toml, one per line: its dependencies
and those of the extras named (``python tools/requirements.py test,tpu-compile``), an extra
that names the project itself (``workbench[profile]``) expanded in place.

The Makefile installs these before Workbench itself, beside ``npm ci``: building
Workbench's editable wheel runs npm on labextension/ and needs its packages, the
dependencies do not. pyproject.toml stays the one list.
"""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, optional = project["name"], project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has "
                             f"{', '.join(sorted(optional))})")
        seen.add(extra)
        for req in optional[extra]:
            own = re.fullmatch(rf"{re.escape(name)}\[([\w,\- ]+)\]", req.strip())
            if own:
                todo += [e.strip() for e in own.group(1).split(",")]
            else:
                out.append(req)
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    print("\n".join(requirements([e for a in sys.argv[1:] for e in a.split(",") if e])))
