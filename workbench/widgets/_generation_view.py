"""The generation view: the text a model writes, growing token by token (anywidget).

``wb.generate(..., stream=view)`` calls the view with the tokens so far after each new
token; it decodes them and sends the text at most ``rate`` times a second (and once more
at ``finish``). It only displays what it is given.
"""
from __future__ import annotations

import time
from typing import Any

import anywidget
import numpy as np
import traitlets

from workbench.widgets import _assets

__all__ = ["GenerationView", "stream_widget"]


def decode(tokens: np.ndarray, tokenizer: Any) -> list[str]:
    """Each row of ``tokens`` (B, S) as text (token ids when there is no tokenizer)."""
    if tokenizer is None:
        return [" ".join(str(int(t)) for t in row) for row in tokens]
    return [tokenizer.decode([int(t) for t in row]) for row in tokens]


class GenerationView(anywidget.AnyWidget):
    """Live text of ``wb.generate(..., stream=view)``: prompt, then the new tokens.

    Args:
      tokenizer: decodes token ids (``decode(ids) -> str``); None shows the ids.
      rate: at most this many updates a second are sent to the browser.

    Example::

        view = wb.widgets.GenerationView(tokenizer=tok)
        display(view)
        wb.generate(trainer, "Once upon", tokenizer=tok, max_new_tokens=64, stream=view)
    """

    _esm = _assets.esm("generation")
    _css = _assets.css("generation")
    prompts = traitlets.List([]).tag(sync=True)   # per row: the prompt's text
    texts = traitlets.List([]).tag(sync=True)     # per row: prompt + continuation so far
    tokens = traitlets.Int(0).tag(sync=True)      # new tokens so far (per row)
    state = traitlets.Unicode("waiting").tag(sync=True)
    tokens_per_s = traitlets.Float(None, allow_none=True).tag(sync=True)

    def __init__(self, tokenizer: Any = None, *, rate: float = 20.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokenizer, self.interval = tokenizer, 1.0 / rate
        self._latest: np.ndarray | None = None
        self._prompt_len = 0
        self._t0 = 0.0
        self._last_send = 0.0

    def __call__(self, tokens: np.ndarray) -> None:
        """Takes the tokens so far ``(B, T + i)``; sends them if ``1/rate`` s passed."""
        tokens = np.asarray(tokens)
        if self._latest is None:                       # the first new token
            self._prompt_len, self._t0 = tokens.shape[1] - 1, time.perf_counter()
            self.prompts = decode(tokens[:, :self._prompt_len], self.tokenizer)
        self._latest = tokens
        if time.monotonic() - self._last_send >= self.interval:
            self._push("generating")

    def finish(self) -> None:
        """Sends the final text (called by ``wb.generate`` at the end)."""
        self._push("done")

    def _push(self, state: str) -> None:
        with self.hold_sync():
            if self._latest is not None:
                n = self._latest.shape[1] - self._prompt_len
                self.texts = decode(self._latest, self.tokenizer)
                self.tokens = n
                secs = time.perf_counter() - self._t0
                self.tokens_per_s = n / secs if n > 1 and secs > 0 else None
            self.state = state
        self._last_send = time.monotonic()

    def __repr__(self) -> str:
        """Text form: the state and the text of each row."""
        rows = "\n".join(self.texts or self.prompts)
        return f"GenerationView({self.state}, {self.tokens} new tokens)" + \
            (f":\n{rows}" if rows else "")


def stream_widget(tokenizer: Any = None) -> GenerationView:
    """A :class:`GenerationView` shown in the current cell (``wb.generate(stream=True)``)."""
    from IPython.display import display

    view = GenerationView(tokenizer)
    display(view)
    return view
