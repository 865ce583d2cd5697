"""The pieces of optimised HLO text every reader needs: computations and array bytes."""
from __future__ import annotations

import math
import re

#: Bytes per element of each HLO element type.
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
#: The header line of a computation (its name in group 1).
COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def array_bytes(type_text: str, kind: str, is_start: bool) -> tuple[int, tuple[str, ...]]:
    """Bytes and shapes of the arrays in an instruction's result type (an async start's
    operands left out: its tuple holds operands and outputs)."""
    arrays = [(dt, dims) for dt, dims in _ARRAY.findall(type_text) if dt in DTYPE_BYTES]
    if is_start and kind in ("all-gather", "collective-permute"):
        arrays = [a for a in arrays if a[1]]               # drop u32[] sync contexts
        arrays = arrays[len(arrays) // 2:]                 # (operands..., outputs...)
    shapes = tuple(f"{dt}[{dims}]" for dt, dims in arrays)
    total = sum(DTYPE_BYTES[dt] * math.prod(int(x) for x in dims.split(",") if x)
                for dt, dims in arrays)
    return int(total), shapes


def computations(hlo_text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}`` of a module's text."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        head = COMPUTATION.match(line)
        if head and not line[:1].isspace():
            current = out.setdefault(head.group(1), [])
            continue
        if current is not None:
            current.append(line)
    return out


#: An instruction line (the name it defines in group 1).
DEFINES = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
