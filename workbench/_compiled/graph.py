"""The instruction graph of an HLO module: each op's operands, users and source line."""
from __future__ import annotations

import dataclasses
import functools
import re

from workbench._compiled.text import COMPUTATION

_OP_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                      r"(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$")


_META_OP = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


_META_FRAME = re.compile(r"stack_frame_id=(\d+)")


_META_FILE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')


_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")


#: Frames of these libraries (and Workbench's step plumbing) are not "the source line".
_LIBRARY = re.compile(r"/(jax|jaxlib|flax|optax|numpy|qwix)/|/workbench/((_sharding/|_)?rules|"
                      r"_?step|planning/_?planner|planning/_?activations|models/_fp8)\.py$|^<")


_PASS_THROUGH = {"bitcast", "copy", "reshape", "convert", "transpose", "get-tuple-element",
                 "broadcast", "slice", "dynamic-slice", "copy-start", "copy-done",
                 "all-gather-done", "all-reduce-done", "collective-permute-done",
                 "optimization-barrier"}


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: name, opcode, result type, operand names, op metadata."""

    name: str
    op: str
    type: str
    operands: tuple[str, ...]
    op_name: str
    frame: int | None
    file_line: tuple[str, int] | None
    computation: str


def short_op(op_name: str) -> str:
    """``'jit(train_step)/jvp(btd,df->btf)/dot_general'`` -> ``'jvp(btd,df->btf)/dot_general'``."""
    return re.sub(r"^jit\([^)]*\)/", "", op_name)


def param_path(op_name: str) -> str | None:
    """``"state.params['blocks'][0]['attn']['k']"`` -> ``'params.blocks.0.attn.k'``."""
    m = re.match(r"^state\.(params|opt_state)(.*)$", op_name.replace("\\'", "'"))
    if m is None:
        b = re.match(r"^batch\['([^']+)'\]$", op_name.replace("\\'", "'"))
        return f"batch.{b.group(1)}" if b else None
    parts = re.findall(r"\[(?:'([^']*)'|(\d+))\]|\.(\w+)", m.group(2))
    return ".".join([m.group(1)] + [a or b or c for a, b, c in parts])


@dataclasses.dataclass
class HloGraph:
    """Instructions of an optimized HLO module with their users and the module's stack
    frame tables (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``)."""

    instructions: dict[str, Instr]
    users: dict[str, list[str]]
    files: dict[int, str]
    functions: dict[int, str]
    locations: dict[int, tuple[int, int, int]]
    frames: dict[int, tuple[int, int]]

    @classmethod
    def parse(cls, hlo_text: str) -> HloGraph:
        """Read the module text (``compiled.as_text()``)."""
        tables: dict[str, dict[int, str]] = {}
        table = None
        instructions: dict[str, Instr] = {}
        users: dict[str, list[str]] = {}
        computation = ""
        for line in hlo_text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = tables.setdefault(line, {})
                continue
            if table is not None:
                row = _TABLE_ROW.match(line)
                if row:
                    table[int(row.group(1))] = row.group(2)
                    continue
                table = None
            head = COMPUTATION.match(line)
            if head and not line[:1].isspace():
                computation = head.group(1)
                continue
            m = _OP_LINE.match(line)
            if m is None:
                continue
            operands = tuple(re.findall(r"%([\w.\-]+)", m.group("args")))
            attrs = m.group("attrs")
            meta_op = _META_OP.search(attrs)
            frame = _META_FRAME.search(attrs)
            file_line = _META_FILE.search(attrs)
            ins = Instr(name=m.group("name"), op=m.group("op"), type=m.group("type"),
                        operands=operands, op_name=meta_op.group(1) if meta_op else "",
                        frame=int(frame.group(1)) if frame else None,
                        file_line=(file_line.group(1), int(file_line.group(2)))
                        if file_line else None, computation=computation)
            instructions[ins.name] = ins
            for o in operands:
                users.setdefault(o, []).append(ins.name)

        def ints(text: str, key: str) -> int:
            m = re.search(rf"\b{key}=(\d+)", text)
            return int(m.group(1)) if m else 0

        return cls(
            instructions=instructions, users=users,
            files={k: v.strip('"') for k, v in tables.get("FileNames", {}).items()},
            functions={k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()},
            locations={k: (ints(v, "file_name_id"), ints(v, "function_name_id"),
                           ints(v, "line")) for k, v in tables.get("FileLocations", {}).items()},
            frames={k: (ints(v, "file_location_id"), ints(v, "parent_frame_id"))
                    for k, v in tables.get("StackFrames", {}).items()})

    def stack(self, ins: Instr) -> list[tuple[str, int, str]]:
        """``[(file, line, function), ...]`` innermost first, for ``ins``'s op."""
        out: list[tuple[str, int, str]] = []
        if ins.file_line is not None:
            out.append((ins.file_line[0], ins.file_line[1], ""))
        frame, seen = ins.frame, set()
        while frame and frame in self.frames and frame not in seen:
            seen.add(frame)
            loc, parent = self.frames[frame]
            if loc in self.locations:
                f, fn, line = self.locations[loc]
                out.append((self.files.get(f, "?"), line, self.functions.get(fn, "?")))
            if parent == frame:
                break
            frame = parent
        return out

    def source(self, ins: Instr) -> str:
        """The innermost frame outside JAX, Flax, optax and Workbench's step plumbing:
        ``'_layers.py:101 in MLP.__call__'`` (empty when the op has no metadata)."""
        for file, line, fn in self.stack(ins):
            if not _LIBRARY.search(file):
                return f"{file.rsplit('/', 1)[-1]}:{line}" + (f" in {fn}" if fn else "")
        return ""

    def source_location(self, ins: Instr) -> tuple[str, int] | None:
        """``(full file path, line)`` of :meth:`source`."""
        for file, line, _ in self.stack(ins):
            if not _LIBRARY.search(file):
                return file, line
        return None

    def producer(self, ins: Instr) -> Instr | None:
        """The instruction that made ``ins``'s first operand, looking through layout-only
        ops (bitcast, copy, reshape, ...); None for none."""
        cur = ins
        for _ in range(12):
            if not cur.operands:
                return None
            nxt = self.instructions.get(cur.operands[0])
            if nxt is None:
                return None
            if nxt.op not in _PASS_THROUGH:
                return nxt
            cur = nxt
        return None

    def consumer(self, ins: Instr) -> Instr | None:
        """The first instruction that uses ``ins``'s result, looking through layout-only
        ops; None for none."""
        cur = ins
        for _ in range(12):
            names = self.users.get(cur.name, [])
            if not names:
                return None
            nxt = self.instructions[names[0]]
            if nxt.op not in _PASS_THROUGH or nxt.op.endswith("-done"):
                if nxt.op.endswith("-done"):
                    cur = nxt
                    continue
                return nxt
            cur = nxt
        return None

    def moved_tensor(self, ins: Instr) -> str:
        """What a collective moves: the parameter or batch entry its operand is (through
        layout-only ops), else ``'<op> (file:line)'`` of the op that produced it."""
        cur = ins
        for _ in range(12):
            if not cur.operands:
                break
            nxt = self.instructions.get(cur.operands[0])
            if nxt is None:
                break
            path = param_path(nxt.op_name)
            if path:
                return path
            if nxt.op == "parameter":
                break
            if nxt.op not in _PASS_THROUGH:
                src = self.source(nxt) or self.source(ins)
                what = short_op(nxt.op_name or ins.op_name) or nxt.op
                return f"{what} ({src})" if src else what
            cur = nxt
        src = self.source(ins)
        return f"{short_op(ins.op_name)} ({src})" if src else short_op(ins.op_name)


@functools.lru_cache(maxsize=4)
def module_graph(hlo_text: str) -> HloGraph:
    """``HloGraph.parse``, once per module text: a plan reads its collectives and its
    reshards from the same text (seconds of regex for a large step). Read-only."""
    return HloGraph.parse(hlo_text)


def described_by(graph: HloGraph, ins: Instr) -> Instr:
    """The instruction whose metadata says what a collective is for: its own, or, where it
    has no source line (XLA since JAX 0.12 gives a parameter's gather the parameter's name
    and no stack), the op that uses what it moved (the matmul that needs the weight)."""
    if graph.source(ins):
        return ins
    todo, seen, first = [ins], {ins.name}, None
    for _ in range(6):                      # breadth first, through copies and layout fusions
        for cur in todo:
            if graph.source(cur):
                if cur.op in ("dot", "convolution") or "dot_general" in cur.op_name:
                    return cur              # the matmul that uses the weight
                first = first or cur
        todo = [graph.instructions[n] for cur in todo for n in graph.users.get(cur.name, [])
                if n in graph.instructions and n not in seen]
        seen.update(cur.name for cur in todo)
    return first or ins


def dot_dtypes(hlo_text: str) -> dict[tuple[str, str], int]:
    """The matmuls of an optimized HLO module by their operands' element types: each
    ``dot`` and ``convolution`` (fused ones included; the TPU compiler writes matmuls as
    convolutions), ``{("f8e4m3fn", "f8e4m3fn"): 14, ("bf16", "bf16"): 3, ...}``, counted
    once per instruction (a loop body's once). A Pallas kernel is a custom call: not here.

    Example::

        dot_dtypes(plan.compiled.as_text())   # fp8 projections: f8e4m3fn / f8e5m2 pairs
    """
    graph = module_graph(hlo_text)
    out: dict[tuple[str, str], int] = {}
    for ins in graph.instructions.values():
        if ins.op not in ("dot", "convolution") or len(ins.operands) < 2:
            continue
        types = tuple(graph.instructions[o].type.split("[")[0].strip("(")
                      if o in graph.instructions else "?" for o in ins.operands[:2])
        out[types] = out.get(types, 0) + 1
    return out
