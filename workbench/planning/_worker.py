"""The worker process of a background plan (``planning._background``): rebuilds the plan's
abstract step from the request in ``<folder>/request.pkl``, compiles it as a blocking plan
does, and writes the answer (or the error) to ``<folder>/answer.pkl``.

Run as ``python -m workbench.planning._worker <folder>``; never imported by the package.
"""
from __future__ import annotations

import pickle
import sys
import traceback
import warnings
from pathlib import Path


def main(folder: Path) -> int:
    """Compile the request of ``folder``; 0 when an answer (or the plan's error) is written."""
    try:
        answer = _answer(folder / "request.pkl")
    except Exception as err:  # noqa: BLE001 - the plan's own error, raised in the kernel
        answer = {"error": {"type": type(err).__name__, "message": str(err),
                            "traceback": traceback.format_exc()}}
    tmp = folder / "answer.pkl.tmp"
    tmp.write_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    tmp.replace(folder / "answer.pkl")
    return 0


def _answer(path: Path) -> dict:
    from workbench.planning import _background as background
    from workbench.planning._measure import compile_outcome
    from workbench.planning._stages import build_step, choose_target, resolve

    request = background.loads(path.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # said in the kernel already
        inp = resolve(request.model, **request.resolve)
        setup = choose_target(inp)
        step = build_step(inp, setup)
        return background.answer_of(compile_outcome(inp, setup, step, progress=False))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
