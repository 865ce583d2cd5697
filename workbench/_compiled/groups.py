"""Replica groups of an HLO collective, in any of its printed formats, and the mesh axes they span.

JAX 0.10 prints replica groups in several formats; all are turned into explicit groups of
*logical* device ids (positions in the mesh's flat device order), then into mesh axes:

- explicit ``replica_groups={{0,1},{2,3}}`` (``{}`` means one group of every device);
- iota ``replica_groups=[2,4]<=[8]`` and ``[2,4]<=[4,2]T(1,0)`` (reshape, transpose, reshape);
- mesh ``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``, optionally with
  ``device_ids=([4,2]T(1,0))`` giving the devices in that mesh's order;
- ``source_target_pairs={{0,1},{1,0}}`` for collective-permute.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np


def _iota(spec: str) -> np.ndarray:
    """``'[2,4]<=[4,2]T(1,0)'`` or ``'[4,2]T(1,0)'`` or ``'[8]'`` -> array of device ids."""
    m = re.fullmatch(r"\s*(?:\[([\d,]*)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", spec)
    if m is None:
        raise ValueError(f"cannot parse iota device list {spec!r}")
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    if m.group(1):
        ids = ids.reshape([int(x) for x in m.group(1).split(",")])
    return ids


def _braces(text: str) -> list[list[int]]:
    """``'{{0,1},{2,3}}'`` -> [[0, 1], [2, 3]]; ``'{}'`` -> []."""
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}",
                                                                             text[1:-1])]


def parse_replica_groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """Replica groups (logical device ids) of one instruction's attribute text, or None."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        if m.group(2):
            dev = m.group(2).strip()
            ids = (_iota(dev).reshape(-1) if dev.startswith("[")
                   else np.array([int(x) for x in dev.split(",")]))
        else:
            ids = np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        varying = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        fixed = [i for i in range(len(sizes)) if i not in varying]
        grid = grid.transpose(fixed + varying)
        return grid.reshape(-1, math.prod(sizes[i] for i in varying) if varying else 1).tolist()
    m = re.search(r"replica_groups=(\[[\d,]*\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        ids = _iota(m.group(1))
        return ids.reshape(ids.shape[0] if ids.ndim > 1 else 1, -1).tolist()
    m = re.search(r"replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\})", attrs)
    if m:
        groups = _braces(m.group(1))
        return groups or [list(range(n_devices))]
    return None


def groups_to_axes(groups: Sequence[Sequence[int]], axis_names: Sequence[str],
                   axis_sizes: Sequence[int]) -> tuple[tuple[str, ...], bool]:
    """Mesh axes spanned by ``groups`` of logical ids, and whether each group is exactly the
    sub-mesh along those axes (ids are positions in the mesh's row-major order)."""
    n = math.prod(axis_sizes)
    varying: set[int] = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=np.int64) % n, axis_sizes)).T
        varying |= {i for i in range(len(axis_sizes)) if len(np.unique(coords[:, i])) > 1}
    axes = tuple(axis_names[i] for i in sorted(varying))
    expected = math.prod(axis_sizes[i] for i in varying)
    aligned = all(len(set(g)) == expected for g in groups) and \
        sum(len(g) for g in groups) == n
    return axes, aligned


def pairs_axes(attrs: str, axis_names: Sequence[str],
                axis_sizes: Sequence[int]) -> tuple[tuple[str, ...], int]:
    m = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?\s*)*\})", attrs)
    pairs = [p for p in _braces(m.group(1)) if len(p) == 2 and p[0] != p[1]] if m else []
    varying: set[int] = set()
    for s, t in pairs:
        cs, ct = np.unravel_index(s, axis_sizes), np.unravel_index(t, axis_sizes)
        varying |= {i for i in range(len(axis_sizes)) if cs[i] != ct[i]}
    return tuple(axis_names[i] for i in sorted(varying)), 2 if pairs else 1
