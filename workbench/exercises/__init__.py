"""Exercises that check a learner's answer against JAX and explain what is wrong.

Usage::

    import workbench as wb

    wb.exercise("spec_for_block")                  # in a notebook: prompt, answer box, check
    r = wb.exercise("spec_for_block").check("P('data', None, 'model')")
    r.correct, r.explanation                       # in a terminal

Every check computes the answer with JAX (``NamedSharding.shard_shape``,
``devices_indices_map``, a ``jit(...).lower().compile()`` read for its collectives and
FLOPs, optax's real state shapes) rather than from a stored key, so an explanation says
what the learner's own answer gives. Headless: the widget is imported only on display.

Writing a new exercise (for instructors): a function returning an ``Exercise`` whose
``parse`` reads the typed text (``parse_spec``, ``parse_axes``, ``parse_number``,
``parse_choice``, ``parse_ranges`` in ``_core``) and whose ``judge`` computes the
verdict with JAX and says, for a wrong answer, what that answer gives; add it to
``_registry._BUILDERS`` and give it a right and a wrong answer in ``tests/test_exercises.py``.
"""
from workbench.exercises._core import AnswerError, Exercise, Result
from workbench.exercises._registry import UnknownExercise, exercise, exercises

__all__ = ["AnswerError", "Exercise", "Result", "UnknownExercise", "exercise", "exercises"]
