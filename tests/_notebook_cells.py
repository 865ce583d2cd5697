"""Which cells of a notebook its second run in the same folder runs again.

A notebook's second run (tests/test_notebooks.py) checks what the first run left in its
folder: the run directories, checkpoints, configs and job folders a learner finds when
running it again from the top. A cell that never looked at the folder in the first run
meets nothing new in the second (its plans and compiled steps are read back from the
cache, which tests/test_tpu_plans.py and the compile-cache tests check on their own), so
running it again repeated what the first run proved. The second run keeps:

1. the cells that touched the folder in the first run: an audit hook in the kernel
   (:data:`AUDIT_SOURCE`, the first cell of the first run) records, per cell, every
   ``open``, directory listing, ``mkdir``/rename/remove/``rmtree``/copy and every process
   started with the folder as its working directory (a job, the CLI, SLURM's ``sbatch``),
   but not the import system's searches of ``sys.path``'s ``''`` (every ``import`` lists
   the folder; where the first run left a module there, every cell runs again);
2. the cells whose string constants name an entry the first run left at the folder's top
   (``"runs/05-resumable"``, ``"corpus.txt"``): a cell that only asks whether a path
   exists makes no audited call, but names it;
3. the first code cell (simulated devices, imports) and, transitively, every earlier cell
   that binds or changes a name a kept cell reads (an assignment, an import, a ``def``, an
   attribute or item assignment, a method call on it): so each kept cell runs on the same
   objects as in the first run.

The audit hook sees the kernel's own calls, from any thread, each attributed to the cell
that ran last (a checkpoint thread still writing when the next cell starts counts for
that cell too: more cells kept, never fewer).
"""
from __future__ import annotations

import ast
import contextlib
import json
import pathlib
from collections.abc import Mapping

__all__ = ["AUDIT_SOURCE", "audit_cell", "second_run", "second_run_cells", "touched_cells"]

#: The audited calls (Python's audit events) and the argument positions holding paths.
AUDITED = {
    "open": (0,), "os.listdir": (0,), "os.scandir": (0,), "os.mkdir": (0,),
    "os.rename": (0, 1), "os.replace": (0, 1), "os.remove": (0,), "os.rmdir": (0,),
    "os.symlink": (0, 1), "os.link": (0, 1), "os.truncate": (0,), "os.chmod": (0,),
    "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (0, 1),
    "shutil.copytree": (0, 1), "shutil.move": (0, 1), "shutil.unpack_archive": (0, 1),
    "glob.glob": (0,), "os.chdir": (0,),
}

#: The code of the first run's extra first cell. ``__REPORT__``: the JSON file (outside the
#: folder) it keeps up to date: ``{"cells": [source of each cell that touched the folder],
#: "calls": [the first such call of each, as "event args"]}``.
#: Cells are named by their source (IPython's ``pre_run_cell`` gives the source, not the
#: notebook's index); two cells of the same source both count as touched.
AUDIT_SOURCE = '''\
def _workbench_test_audit(report, audited):
    import json, os, sys, threading
    from IPython import get_ipython

    folder = os.path.realpath(os.getcwd())
    inside = (folder, folder + os.sep)
    state = {"cell": None, "touched": [], "calls": [], "busy": threading.local()}

    def under(path, relative_to_fd=False):
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            return False   # a file descriptor
        full = os.path.normpath(os.path.join(os.getcwd(), path))
        if not (full == inside[0] or full.startswith(inside[1])):
            return False
        if relative_to_fd and not os.path.isabs(path):
            # os.open(name, dir_fd=...): the event has no dir_fd, so a relative name
            # counts where the folder holds its first component
            first = os.path.relpath(full, folder).split(os.sep)[0]
            return first != ".." and os.path.lexists(os.path.join(folder, first))
        return True

    def by_the_import_system():
        frame = sys._getframe(2)
        while frame is not None:
            if "importlib" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def save():
        with open(report, "w") as f:
            json.dump({"cells": state["touched"], "calls": state["calls"]}, f)

    def hook(event, args):
        where = audited.get(event)
        if where is None and event != "subprocess.Popen":
            return
        cell = state["cell"]
        if cell is None or cell in state["touched"] or getattr(state["busy"], "on", False):
            return
        state["busy"].on = True
        try:
            if event == "subprocess.Popen":   # (executable, args, cwd, env)
                hit = args[2] is None or under(args[2])
            elif event == "open" and args[1] is None:   # os.open: (path, None, flags)
                hit = under(args[0], relative_to_fd=True)
            else:
                hit = any(i < len(args) and args[i] is not None and under(args[i])
                          for i in where)
                if hit and event in ("os.listdir", "os.scandir") and by_the_import_system():
                    hit = False   # sys.path's '' (the folder) searched for a module
            if hit:
                state["touched"].append(cell)
                state["calls"].append(f"{event} {str(args[:3])[:200]}")
                save()
        except Exception:   # an audit hook's error would fail the audited call itself
            pass
        finally:
            state["busy"].on = False

    def pre_run_cell(info):
        state["cell"] = info.raw_cell

    save()
    get_ipython().events.register("pre_run_cell", pre_run_cell)
    sys.addaudithook(hook)


_workbench_test_audit(__REPORT__, __AUDITED__)
del _workbench_test_audit
'''


def audit_cell(report: pathlib.Path) -> str:
    """The first run's extra first cell, recording into ``report``."""
    return AUDIT_SOURCE.replace("__REPORT__", repr(str(report))).replace("__AUDITED__",
                                                                       repr(AUDITED))


def touched_cells(report: pathlib.Path, sources: list[str]) -> dict[int, str]:
    """The cells the first run's audit recorded as touching the folder: index into
    ``sources`` (the notebook's code cells) -> the first such call."""
    saved = json.loads(report.read_text())
    calls = dict(zip(saved["cells"], saved["calls"]))
    return {i: calls[src] for i, src in enumerate(sources) if src in calls}


def second_run(folder: pathlib.Path, sources: list[str],
               report: pathlib.Path) -> tuple[list[int], dict[int, str]]:
    """:func:`second_run_cells` of the notebook whose code cells are ``sources``, from its
    first run's audit ``report`` and what it left in ``folder``. Where the folder holds a
    Python module or package (which an ``import`` in any cell would find: the kernel's
    ``sys.path`` starts with it), every cell runs again."""
    importable = sorted(p.name for p in folder.iterdir()
                        if p.suffix in (".py", ".pth") or (p / "__init__.py").exists())
    if importable:
        return list(range(len(sources))), dict.fromkeys(
            range(len(sources)), f"the folder holds {importable[0]}, which imports find")
    return second_run_cells(sources, touched_cells(report, sources),
                            {p.name for p in folder.iterdir()})


def second_run_cells(sources: list[str], touched: Mapping[int, str] | set[int],
                     entries: set[str]) -> tuple[list[int], dict[int, str]]:
    """The indices of the code cells the second run runs, in order, and why each is kept.

    ``sources``: the code cells' sources; ``touched``: those that touched the folder in the
    first run; ``entries``: the names at the folder's top after it."""
    why: dict[int, str] = {}
    if not sources:
        return [], why
    why[0] = "the first cell"
    for i in sorted(touched):
        call = touched.get(i) if isinstance(touched, Mapping) else None
        why.setdefault(i, f"touched the folder: {call}" if call else "touched the folder")
    for i, src in enumerate(sources):
        named = sorted(e for e in entries if any(_names_entry(s, e) for s in _strings(src)))
        if named:
            why.setdefault(i, f"names {named[0]!r}")
    cells = [_Cell(src) for src in sources]
    modules = set().union(*(c.modules for c in cells))
    todo = sorted(why)
    while todo:
        j = todo.pop()
        for name in cells[j].loads - modules:
            binder = next((i for i in range(j - 1, -1, -1) if name in cells[i].binds), None)
            if binder is None:
                continue
            for i in range(binder, j):
                if name in cells[i].binds | cells[i].changes and i not in why:
                    why[i] = f"binds {name}" if name in cells[i].binds else f"changes {name}"
                    todo.append(i)
        for name in cells[j].loads & modules:   # an alias: the cell that imports it
            binder = next((i for i in range(j - 1, -1, -1) if name in cells[i].binds), None)
            if binder is not None and binder not in why:
                why[binder] = f"imports {name}"
                todo.append(binder)
    return sorted(why), why


def _names_entry(text: str, entry: str) -> bool:
    """Whether a string constant names the folder's top-level ``entry`` (as the path
    itself, or its first component)."""
    first = text.strip().lstrip("./").split("/", 1)[0]
    return bool(first) and first == entry


def _strings(src: str) -> list[str]:
    try:
        tree = ast.parse(_python(src))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return found


def _python(src: str) -> str:
    """``src`` with IPython's syntax (magics, ``!`` commands) turned into Python."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(src)


class _Cell:
    """The names a cell reads (``loads``), binds (assignment, import, def, for, with,
    walrus, del), changes (``x.a = ...``, ``x[i] = ...``, ``x.m(...)``), and imports as
    modules (``modules``)."""

    def __init__(self, src: str) -> None:
        self.loads: set[str] = set()
        self.binds: set[str] = set()
        self.changes: set[str] = set()
        self.modules: set[str] = set()
        try:
            trees = [ast.parse(_python(src))]
        except SyntaxError:
            return
        for node in ast.walk(trees[0]):   # a magic's code (%time f(x)) is a string there
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("run_line_magic", "run_cell_magic"):
                for arg in node.args[1:]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        with contextlib.suppress(SyntaxError):
                            trees.append(ast.parse(arg.value))
        for node in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(node, ast.Name):
                (self.loads if isinstance(node.ctx, ast.Load) else self.binds).add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    name = (alias.asname or alias.name).split(".")[0]
                    self.binds.add(name)
                    if isinstance(node, ast.Import) or alias.asname is None:
                        self.modules.add(name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.binds.add(node.name)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                self.loads.add(node.target.id)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) \
                    and isinstance(node.ctx, (ast.Store, ast.Del)):
                base = _base(node)
                if base:
                    self.changes.add(base)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = _base(node.func)
                if base:
                    self.changes.add(base)


def _base(node: ast.AST) -> str | None:
    """The name at the root of ``a.b[c].d``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None
