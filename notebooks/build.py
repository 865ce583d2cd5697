"""Build the teaching notebooks (*.ipynb, outputs stripped) from their sources in source/.

A source is a Python file in "percent" format: ``# %%`` starts a code cell and
``# %% [markdown]`` a markdown cell whose lines start with ``# ``. Edit the source, then::

    python notebooks/build.py           # rewrite every notebook
    python notebooks/build.py --check   # exit 1 if a notebook differs from its source

The .ipynb files are the product (what JupyterLab and Binder open); the sources keep
them reviewable as plain diffs. tests/test_notebooks.py runs ``--check``.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import stat
import sys
import tempfile

import nbformat

HERE = pathlib.Path(__file__).parent
SOURCES = HERE / "source"

_KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def _cells(text: str) -> list[nbformat.NotebookNode]:
    cells: list[nbformat.NotebookNode] = []
    kind, lines = None, []

    def flush() -> None:
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(ln[2:] if ln.startswith("# ") else ln.lstrip("#")
                             for ln in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif kind == "code" and body:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def build(source: pathlib.Path) -> str:
    """The .ipynb text for one source file (deterministic: cell ids from the position)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = _cells(source.read_text())
    for i, cell in enumerate(nb.cells):
        cell.id = f"{source.stem[:2]}-{i:02d}"
    nb.metadata = {"kernelspec": _KERNEL, "language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def _not_a_notebook(target: pathlib.Path) -> str | None:
    """Why ``target`` may not be replaced by a built notebook (None: absent, or a regular
    file). A symlink would be written through to its target, a directory or pipe is not a
    notebook: each is refused, never replaced."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return f"is a symlink (to {os.readlink(target)}), not a notebook file"
    return "is a directory" if stat.S_ISDIR(mode) else "is not a regular file (a pipe?)"


def _write(target: pathlib.Path, text: str) -> None:
    """Writes ``target`` through a temporary file of its own, renamed over it: an
    interrupted build leaves the old notebook whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # what a plain write would give (mkstemp's is 0600)
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("[0-9]*.py")):
        target = HERE / f"{source.stem}.ipynb"
        text = build(source)
        problem = _not_a_notebook(target)
        if problem is not None:
            print(f"{target} {problem}; it is never replaced: move it away, then run "
                  "python notebooks/build.py", file=sys.stderr)
            return 1
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            _write(target, text)
    if args.check and stale:
        print(f"out of date with notebooks/source/: {', '.join(stale)}; run "
              "python notebooks/build.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote notebooks/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
