"""Old module paths that keep working, with a ``DeprecationWarning`` naming the new one.

The implementation modules are private (``workbench/perf/_predict.py``); each package's
``__init__`` is its public surface. Code written against the old paths
(``from workbench.perf.predict import predict``, ``import workbench.step``, a pickle that
names ``workbench.data.tokenizer.Tokenizer``) still imports: :class:`OldPaths`, a finder
at the end of ``sys.meta_path`` (so it is asked only after the real modules were not
found), answers an old path with the module object of its new one, once, and warns.

Two kinds of old path:

- a module made private in place: ``workbench.<pkg>.<name>`` is ``workbench.<pkg>._<name>``
  where that file exists (found on the package's own path, so nothing else is imported);
- a module that moved to another package earlier (:data:`MOVED`), private paths too
  (``workbench._rules`` is now ``workbench._sharding.rules``; a pickle naming
  ``workbench._rules.Rules`` or ``workbench.rules.Rules`` loads the same class).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

#: Modules that moved to another package (round three): old path -> new (private) path.
MOVED: dict[str, str] = {
    "workbench.planning.analytic": "workbench.perf._analytic",
    "workbench.planning.attention_cost": "workbench.perf._attention_cost",
    "workbench.planning.bounds": "workbench.perf._bounds",
    "workbench.planning.calibrate": "workbench.perf._calibrate",
    "workbench.planning.hlo": "workbench._compiled.hlo",
    "workbench.planning.predict": "workbench.perf._predict",
    "workbench.planning.profile": "workbench.perf._profile",
    "workbench.planning.trace": "workbench.perf._trace",
    "workbench.planning.schedule": "workbench.models._schedule",
    "workbench.models.hf": "workbench.hf._load",
    "workbench.models.hf_export": "workbench.hf._save",
    "workbench.models.hf_families": "workbench.hf._families",
    "workbench.models.hf_tensors": "workbench.hf._tensors",
    "workbench.train.export": "workbench.hf._export",
    "workbench.models.adapters": "workbench.any_model._spec",
    "workbench.models.penzai_adapter": "workbench.any_model._penzai",
    "workbench.models.mlp": "workbench.any_model._mlp",
    # KV-cache decoding sits above models (round four): it uses the model, models never use it
    "workbench.models.generate": "workbench._generate",
    "workbench.models._generate": "workbench._generate",
    # the HLO reader is a leaf below hardware, planning and perf (round four)
    "workbench.perf.hlo": "workbench._compiled.hlo",
    "workbench.perf._hlo": "workbench._compiled.hlo",
}
#: The sharding modules (round four): public ``workbench.mesh`` before round three, private
#: ``workbench._mesh`` in it, ``workbench._sharding.mesh`` now (both old paths still import).
SHARDING = ("mesh", "rules", "layouts", "placement", "topology", "pytrees", "tracing")
MOVED.update({f"workbench.{prefix}{name}": f"workbench._sharding.{name}"
              for name in SHARDING for prefix in ("", "_")})
#: The layout search left ``planning`` (round four): ``workbench.planning._search_space`` (and
#: ``workbench.planning.search_space`` before it) is ``workbench._search.space`` now.
MOVED.update({f"workbench.planning.{prefix}{old}": f"workbench._search.{new}"
              for old, new in (("search", "search"), ("search_space", "space"),
                               ("search_result", "result"))
              for prefix in ("", "_")})


def new_path(old: str) -> str | None:
    """The module that serves the old path ``old``, or None where it is not an old path."""
    if old in MOVED:
        return MOVED[old]
    parent, _, name = old.rpartition(".")
    if not parent.startswith("workbench") or not name or name.startswith("_"):
        return None
    package = sys.modules.get(parent)
    search = getattr(package, "__path__", None)
    if search is None:
        return None
    if importlib.machinery.PathFinder.find_spec("_" + name, list(search)) is None:
        return None
    return f"{parent}._{name}"


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module object of its new one."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        public = self.new.split("._")[0]
        warnings.warn(f"{self.old} is now {self.new}, a private module; import its public "
                      f"names from {public} (the old path will go)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        """The module was executed under its new name."""


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds an old module path (:func:`new_path`) after every real finder has not."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("workbench."):
            return None
        new = new_path(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(fullname, new))


def install() -> None:
    """Appends the finder to ``sys.meta_path`` once (``import workbench`` calls it)."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.append(OldPaths())
