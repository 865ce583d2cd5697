"""The Workbench jupyter_server extension: configuration, and the wiring of hub and handlers."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Float, Int, List, Unicode

from workbench.server._handlers import handlers
from workbench.server._hub import Hub
from workbench.server._index import RunIndex
from workbench.server._reads import Reads


class WorkbenchExtension(ExtensionApp):
    """Serves the runs under the server's root and ``run_roots`` to the Workbench lab panel.

    Configure in ``jupyter_server_config.py``::

        c.WorkbenchExtension.run_roots = ["/data/runs"]
        c.WorkbenchExtension.max_depth = 4
    """

    name = "workbench"
    load_other_extensions = True

    run_roots = List(Unicode(), default_value=[], config=True,
                     help="Extra directories searched for runs, besides the server's root "
                          "directory (relative paths are relative to the root directory).")
    include_root_dir = Bool(True, config=True,
                            help="Search the server's root directory for runs (else only run_roots).")
    max_depth = Int(4, config=True, help="How many directory levels below a root to search "
                                         "for run.json.")
    poll_interval = Float(0.25, config=True, help="Seconds between polls of the run files "
                                                  "while a websocket listens.")
    poll_share = Float(0.02, config=True, help="Fraction of one core a poll may spend "
                                               "looking for changes in runs nobody has open "
                                               "(with 10,000 runs each is looked at every "
                                               "few seconds).")
    scan_interval = Float(2.0, config=True, help="Seconds between directory scans for new runs.")
    read_workers = Int(8, config=True, help="File reads (polls, metrics, profiles) that run at "
                                            "once; more wait for a free one.")
    read_timeout = Float(10.0, config=True, help="Seconds a request waits for a free file "
                                                 "reader, and then for its read, before it "
                                                 "answers 503.")

    def roots(self) -> list[Path]:
        """The run roots, the server's root directory first; duplicates dropped."""
        base = Path(os.path.expanduser(self.serverapp.root_dir)).resolve()
        out: list[Path] = [base] if self.include_root_dir else []
        for r in self.run_roots:
            p = Path(os.path.expanduser(r))
            p = (p if p.is_absolute() else base / p).resolve()
            if p not in out:
                out.append(p)
        return out

    def allow_hidden(self) -> bool:
        """Jupyter's ``ContentsManager.allow_hidden``: whether runs under hidden directories
        are listed and served (as the contents API serves hidden files)."""
        return bool(getattr(self.serverapp.contents_manager, "allow_hidden", False))

    def initialize_settings(self) -> None:
        index = RunIndex(self.roots(), max_depth=self.max_depth, scan_interval=self.scan_interval,
                         allow_hidden=self.allow_hidden())
        self.hub = Hub(index, self.poll_interval,
                       reads=Reads(workers=self.read_workers, timeout=self.read_timeout),
                       poll_share=self.poll_share)
        self.log.info("Workbench runs from %s%s", ", ".join(map(str, index.roots)),
                      " (hidden directories included)" if index.allow_hidden else "")

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers(self.hub))

    async def stop_extension(self) -> None:
        self.hub.stop()


def extension_points() -> list[dict[str, Any]]:
    """The entry for ``_jupyter_server_extension_points``."""
    return [{"module": "workbench.server", "app": WorkbenchExtension}]
