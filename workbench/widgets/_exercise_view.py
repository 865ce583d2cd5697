"""The exercise widget: prompt, answer box, check button and feedback from the kernel."""
from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from workbench.exercises import Exercise, Result
from workbench.widgets import _assets

__all__ = ["ExerciseView", "exercise_widget"]


class ExerciseView(anywidget.AnyWidget):
    """An exercise in a notebook. The browser sends the typed answer; the kernel checks it
    with JAX (``Exercise.check``) and sends back the verdict and explanation.

    Example::

        wb.exercise("spec_for_block")      # displays this widget
    """

    _esm = _assets.esm("exercise")
    _css = _assets.css("exercise")

    name = traitlets.Unicode().tag(sync=True)
    title = traitlets.Unicode().tag(sync=True)
    prompt = traitlets.Unicode().tag(sync=True)
    placeholder = traitlets.Unicode().tag(sync=True)
    answer = traitlets.Unicode("").tag(sync=True)
    #: "" (not checked yet), "checking", "correct", "wrong" or "error".
    status = traitlets.Unicode("").tag(sync=True)
    explanation = traitlets.Unicode("").tag(sync=True)
    hint = traitlets.Unicode("").tag(sync=True)
    attempts = traitlets.Int(0).tag(sync=True)

    def __init__(self, exercise: Exercise, **kwargs: Any) -> None:
        super().__init__(name=exercise.name, title=exercise.title, prompt=exercise.prompt,
                         placeholder=exercise.placeholder, **kwargs)
        self.exercise = exercise
        self.result: Result | None = None
        self.on_msg(self._on_message)

    def __repr__(self) -> str:
        return str(self.exercise)

    def check(self, answer: str | None = None) -> Result:
        """Check ``answer`` (default: the text in the box) and show the verdict."""
        text = self.answer if answer is None else answer
        self.answer = text
        self.status = "checking"
        try:
            result = self.exercise.check(text)
        except Exception as e:
            self.status, self.explanation, self.hint = "error", f"{type(e).__name__}: {e}", ""
            raise
        self.result = result
        self.attempts += 1
        self.explanation = result.explanation
        self.hint = result.hint
        self.status = "correct" if result.correct else "wrong"
        return result

    def _on_message(self, _widget: Any, content: dict, _buffers: list) -> None:
        if isinstance(content, dict) and content.get("type") == "check":
            try:
                self.check(str(content.get("answer", "")))
            except Exception:  # shown in the widget as status "error"; keep the kernel alive
                self.log.exception("checking exercise %r failed", self.name)


def exercise_widget(exercise: Exercise) -> ExerciseView:
    """The widget for ``wb.exercise(name)`` (what ``wb.show`` and notebook display use)."""
    return ExerciseView(exercise)
