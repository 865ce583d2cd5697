"""Exercises on hardware you may not have: hosts, megacore and two-core chips, per-host input
batches."""
from __future__ import annotations

import numpy as np

from workbench.exercises._core import Exercise, Result, parse_axes, parse_number
from workbench._sharding.layouts import layout
from workbench._sharding.mesh import abstract_mesh

__all__ = ["host_batch", "ironwood_devices", "megacore_devices", "tp_within_host"]


def tp_within_host() -> Exercise:
    hardware = "2x8xH100"

    def judge(axes: dict[str, int]) -> Result:
        if set(axes) != {"data", "model"}:
            return Result(correct=False, explanation=(
                f"use exactly the axes 'data' and 'model'; you gave {list(axes)}"))
        try:
            info = abstract_mesh(hardware, **axes)
        except ValueError as e:
            return Result(correct=False, explanation=str(e))
        order = ", ".join(f"{a}={s}" for a, s in axes.items())
        m = info.axis_names.index("model")
        hosts = np.moveaxis(info.process_index, m, -1).reshape(-1, axes["model"])  # (groups, model)
        ids = np.moveaxis(info.device_ids, m, -1).reshape(-1, axes["model"])
        split = [i for i, row in enumerate(hosts) if len(set(row.tolist())) > 1]
        if split:
            g = split[0]
            return Result(correct=False, explanation=(
                f"with {order} (the last axis varies fastest) the 'model' group of devices "
                f"{ids[g].tolist()} sits on hosts {sorted(set(hosts[g].tolist()))}: every "
                "tensor-parallel collective would cross the network instead of NVLink."))
        if axes["model"] < 8:
            return Result(correct=False, explanation=(
                f"with {order} each 'model' group stays on one host, but model={axes['model']} "
                "is not the largest: a host has 8 GPUs on NVLink."))
        return Result(correct=True, explanation=(
            f"with {order} the devices of each 'model' group ({ids[0].tolist()} and "
            f"{ids[1].tolist()}) share a host, so tensor parallelism runs over NVLink and only "
            "the data-parallel gradient reduction crosses the network. The minor (last) mesh "
            "axis varies fastest over device ids, so it is the one that stays local."))

    return Exercise(
        name="tp_within_host", title="Keep tensor parallelism inside a host", notebook="01",
        prompt=("Two servers with 8 H100s each (wb.abstract_mesh('2x8xH100', ...)): GPUs in a "
                "server talk over NVLink, servers over a much slower network. Give the mesh "
                "axes, in order, with 'model' as large as possible while every 'model' group "
                "stays inside one server."),
        placeholder="data=?, model=?  (order matters)",
        hint="device ids fill the mesh in row-major order, host by host; the last axis is the "
             "one whose neighbours are consecutive device ids.",
        solution="data=2, model=8", parse=parse_axes, judge=judge)


def megacore_devices() -> Exercise:
    hardware = "v4-32"

    def judge(value: float) -> Result:
        info = abstract_mesh(hardware)
        n, hosts = info.size, info.n_hosts
        if value == n:
            return Result(correct=True, explanation=(
                f"{hardware} counts TensorCores: 32 cores = {n} chips, and JAX shows one device "
                f"per v4 chip (megacore joins its 2 TensorCores). The slice has {hosts} hosts "
                f"of {n // hosts} chips; each host's jax.local_devices() lists {n // hosts}."))
        why = {32: "that counts TensorCores; a v4 chip has 2, which JAX drives as one device "
                   "(megacore)",
               n // hosts: "that is jax.local_devices() on one host; jax.devices() lists every "
                           "host's devices"}.get(int(value), "count chips, not TensorCores")
        return Result(correct=False, explanation=f"{value:g}: {why}.")

    return Exercise(
        name="megacore_devices", title="How many devices is a v4-32?", notebook="07",
        prompt=("You create a TPU v4-32 slice and run jax.devices() on it (after "
                "jax.distributed.initialize() on every host). How many devices does it list?"),
        placeholder="a number",
        hint="the number in a v4 slice name counts TensorCores; a v4 chip has two.",
        solution="16", parse=parse_number(None), judge=judge)


def ironwood_devices() -> Exercise:
    hardware = "tpu7x-128"

    def judge(value: float) -> Result:
        info = abstract_mesh(hardware)
        n, hosts = info.size, info.n_hosts
        chips = n // 2
        if value == n:
            return Result(correct=True, explanation=(
                f"{hardware} counts TensorCores too, but unlike a v4 or v5p chip (megacore: one "
                f"device) each Ironwood chip's 2 TensorCores are 2 JAX devices: {chips} chips "
                f"in a 4x4x4 cube, {n} devices, on {hosts} hosts of {chips // hosts} chips; "
                f"each host's jax.local_devices() lists {n // hosts}. Memory and peak FLOP/s "
                "per device are half a chip's (96 GiB, 1153 TFLOP/s bf16)."))
        why = {chips: "that counts chips; each Ironwood chip shows its 2 TensorCores as 2 JAX "
                      "devices (no megacore)",
               n // hosts: "that is jax.local_devices() on one host; jax.devices() lists every "
                           "host's devices",
               256: "the name already counts TensorCores, not chips"}.get(
            int(value), "the number in the name counts TensorCores; count JAX devices")
        return Result(correct=False, explanation=f"{value:g}: {why}.")

    return Exercise(
        name="ironwood_devices", title="How many devices is a tpu7x-128?", notebook="07",
        prompt=("MaxText's Ironwood recipes run on a tpu7x-128 slice (a 4x4x4 cube). How many "
                "devices does jax.devices() list on it (after jax.distributed.initialize() on "
                "every host)?"),
        placeholder="a number",
        hint="the number counts TensorCores, as for v4; but does JAX join an Ironwood chip's "
             "two TensorCores into one device? wb.show(wb.abstract_mesh('tpu7x-128')).",
        solution="128", parse=parse_number(None), judge=judge)


def host_batch() -> Exercise:
    hardware, batch, seq = "v5e-16", 256, 2048

    def judge(value: float) -> Result:
        info = abstract_mesh(hardware, data=16)
        lay = layout((batch, seq), ("data", None), info, dtype="int32", name="tokens")
        procs = info.process_index.reshape(-1)
        rows = {}
        for h in np.unique(procs).tolist():
            mine = procs == h
            rows[h] = sorted({(int(a), int(b)) for a, b in
                              zip(lay.starts[mine, 0], lay.stops[mine, 0])})
        per_host = sum(b - a for a, b in rows[0])
        span = f"host 0 holds rows {rows[0][0][0]}:{rows[0][-1][1]}"
        if value == per_host:
            return Result(correct=True, explanation=(
                f"{hardware} has {len(rows)} hosts of {info.size // len(rows)} chips; with "
                f"P('data', None) each chip gets {lay.shard_shape[0]} rows, so {span}: each "
                f"host's input pipeline loads only {per_host} examples per step (e.g. "
                "jax.make_array_from_process_local_data builds the global batch from them)."))
        why = {batch: "that is the global batch; loading it on every host wastes input "
                      "bandwidth 4x and needs care to pick each host's rows",
               lay.shard_shape[0]: "that is one chip's share; a host feeds all of its chips"
               }.get(int(value), "count the rows that the chips of one host hold")
        return Result(correct=False, explanation=f"{value:g}: {why}.")

    return Exercise(
        name="host_batch", title="Input per host on a multi-host slice", notebook="07",
        prompt=("A TPU v5e-16 slice (wb.abstract_mesh('v5e-16', data=16)) trains with a global "
                "batch of 256 sequences laid out P('data', None). How many sequences must "
                "each host's input pipeline load per step?"),
        placeholder="a number",
        hint="a v5e-16 has 16 chips on 4 hosts; each chip holds 256 / 16 rows.",
        solution="64", parse=parse_number(None), judge=judge)
