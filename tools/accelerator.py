"""Prints the accelerator choice for ``make lab`` / ``make install``: ``CHOICE<TAB>SENTENCE``, one
line, the sentence saying what is installed and why.

Runs with the system's Python before ``.venv`` exists, so it loads
``workbench/hardware/_accelerator.py`` by its path (standard library only) instead of
importing the package. ``ACCEL`` in the environment overrides the choice; a bad ``ACCEL``
exits 2 with the reason.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "workbench" / "hardware" / "_accelerator.py"


def main() -> int:
    spec = importlib.util.spec_from_file_location("_workbench_accelerator", SOURCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    try:
        found = module.detect()
    except ValueError as e:
        print(f"error\t{e}")
        return 2
    print(f"{found.choice}\tmake: accelerator {found.choice}, installing "
          f"{module.CHOICES[found.choice]}: {found.why}; override with ACCEL="
          f"{'|'.join(module.CHOICES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
