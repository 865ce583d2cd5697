"""The exercises by name: ``exercise(name)`` and ``exercises(notebook)`` (the implementation
of :mod:`workbench.exercises`; adding one: its docstring)."""
from __future__ import annotations

import difflib
from collections.abc import Callable

from workbench.exercises import (_compiled, _context, _experts, _hardware, _memory,
                                 _pipeline, _sharding)
from workbench.exercises._core import AnswerError, Exercise, Result



class UnknownExercise(KeyError, ValueError):
    """``wb.exercise(name)`` with a name no exercise has (a KeyError, as a lookup; and a
    ValueError, as a bad argument)."""

    def __str__(self) -> str:   # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""

# name -> builder, in teaching order (notebook 01, 02, ...).
_BUILDERS: dict[str, Callable[[], Exercise]] = {
    "mesh_for_block": _sharding.mesh_for_block,
    "tp_within_host": _hardware.tp_within_host,
    "spec_for_block": _sharding.spec_for_block,
    "device_block": _sharding.device_block,
    "replication": _sharding.replication,
    "vocab_padding": _sharding.vocab_padding,
    "fsdp_collective": _compiled.fsdp_collective,
    "repeated_work": _compiled.repeated_work,
    "megatron_mlp": _compiled.megatron_mlp,
    "adam_state_bytes": _memory.adam_state_bytes,
    "megacore_devices": _hardware.megacore_devices,
    "ironwood_devices": _hardware.ironwood_devices,
    "host_batch": _hardware.host_batch,
    "pipeline_bubble": _pipeline.pipeline_bubble,
    "stage_block_bytes": _pipeline.stage_block_bytes,
    "ring_kv_bytes": _context.ring_kv_bytes,
    "moe_all_to_all_axis": _experts.moe_all_to_all_axis,
    "moe_dispatch_bytes": _experts.moe_dispatch_bytes,
}


def exercise(name: str) -> Exercise:
    """The exercise called ``name``; shows as a widget in a notebook.

    Raises:
      UnknownExercise: (a KeyError and a ValueError) an unknown name, with the closest
        known names.
      TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"wb.exercise: name={name!r} is a {type(name).__name__}; give an "
                        f"exercise's name, one of: {', '.join(_BUILDERS)}")
    if name not in _BUILDERS:
        close = difflib.get_close_matches(name, _BUILDERS, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownExercise(f"wb.exercise: no exercise name={name!r}{hint} Known: "
                              f"{', '.join(_BUILDERS)}")
    return _BUILDERS[name]()


def exercises(notebook: str | None = None) -> list[Exercise]:
    """All exercises, or those of one notebook (``"02"`` or ``"02_partition_specs"``)."""
    out = [build() for build in _BUILDERS.values()]
    if notebook is None:
        return out
    return [e for e in out if notebook.startswith(e.notebook) or e.notebook.startswith(notebook)]
