"""``run_async``: an ``async def`` server test run on pytest-jupyter's event loop (shared by
the server tests)."""
from __future__ import annotations

import functools
import inspect
from typing import Any


def run_async(fn: Any) -> Any:
    """Runs an ``async def`` test to completion on pytest-jupyter's event loop."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if "jp_asyncio_loop" not in sig.parameters:
        params.append(inspect.Parameter("jp_asyncio_loop", inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> None:
        loop = kwargs["jp_asyncio_loop"]
        loop.run_until_complete(fn(**{k: v for k, v in kwargs.items() if k in sig.parameters}))

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper
