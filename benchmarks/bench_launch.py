"""Launched jobs: time to the first step, and step time of 2 processes x 4 devices vs 1 x 8.

Both jobs train the same "tiny" config through ``wb.launch`` side by side in one run, so
they pay the same start-up costs; 1 x 8 is one process with no ``jax.distributed`` (what
a notebook does), 2 x 4 adds the coordinator and gloo all-reduces over 127.0.0.1. On a
2-core CPU machine the two processes also share the cores, so the ratio measures the
loopback collectives plus that contention, not what a pod would see.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = 30
WARMUP = 5  # steps left out of the step-time median (first steps include lazy set-up)


def _config() -> Any:
    from workbench.train import TrainConfig

    return TrainConfig(model="tiny", mesh={"data": 8}, rules="fsdp", batch=16, seq=64,
                       steps=STEPS, checkpoint_every=1000, keep=1, seed=0, data="synthetic")


def _first_step_time(job: Any, t0: float, timeout: float = 600) -> float:
    """Seconds from launch() to the first metrics line of step 1 (polled every 20 ms)."""
    path = Path(job.run_dir) / "metrics.jsonl"
    while time.monotonic() - t0 < timeout:
        if path.exists() and '"step":1,' in path.read_text():
            return time.monotonic() - t0
        if job.done:
            raise RuntimeError(f"job ended before its first step:\n{job.tail()}")
        time.sleep(0.02)
    raise TimeoutError(f"no first step within {timeout} s:\n{job.tail()}")


def _job(root: Path, name: str, processes: int, devices: int) -> dict[str, Any]:
    from workbench import _runs as runs
    from workbench.jobs import launch

    t0 = time.monotonic()
    job = launch(_config(), processes=processes, devices_per_process=devices,
                 run_dir=root / name, platform="cpu")
    first = _first_step_time(job, t0)
    status = job.wait(900)
    if status != "finished":
        raise RuntimeError(f"{name} job {status}:\n{job.tail()}")
    records = runs.read_metrics(job.run_dir)
    times = [r["step_time"] for r in records if r["step"] > WARMUP and r.get("step_time")]
    compile_s = next((e.get("seconds") for e in runs.read_events(job.run_dir)
                      if e.get("event") == "compile"), None)
    return {"first_step_s": first, "step_time_s": statistics.median(times),
            "compile_s": compile_s, "losses": [r["loss"] for r in records]}


def _job_cpu(root: Path, name: str, nice: str) -> dict[str, Any]:
    """A 2 x 4 job with gloo's network thread at ``nice`` (WORKBENCH_GLOO_NICE), and the
    CPU seconds its processes used (they are this process's children, reaped by wait)."""
    import resource

    from workbench.jobs._cluster import GLOO_NICE_ENV

    saved = os.environ.get(GLOO_NICE_ENV)
    os.environ[GLOO_NICE_ENV] = nice
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    try:
        out = _job(root, name, 2, 4)
    finally:
        if saved is None:
            os.environ.pop(GLOO_NICE_ENV, None)
        else:
            os.environ[GLOO_NICE_ENV] = saved
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    out["wall_s"] = time.monotonic() - t0
    return out


def _gloo_priority_rows(root: Path) -> list[dict[str, Any]]:
    """2 x 4 jobs with gloo's network thread at nice 0 (as gloo starts it) and at nice 19
    (workbench's default, jobs.cluster._lower_gloo_thread_priority), interleaved in two
    windows of one job each."""
    runs: dict[str, list[dict[str, Any]]] = {"0": [], "19": []}
    for w in range(2):
        for nice in ("0", "19"):
            runs[nice].append(_job_cpu(root, f"nice{nice}-{w}", nice))
    same = all(a["losses"] == runs["0"][0]["losses"] for r in runs.values() for a in r)
    step = {k: [r["step_time_s"] for r in v] for k, v in runs.items()}
    cpu = {k: [r["cpu_s"] for r in v] for k, v in runs.items()}
    ratios = [a / b for a, b in zip(step["0"], step["19"])]
    cpu_ratios = [a / b for a, b in zip(cpu["0"], cpu["19"])]
    fmt = lambda xs, k=1: ", ".join(f"{x:.{k}f}" for x in xs)  # noqa: E731
    return [
        {"name": "launch: 2 x 4 step time, gloo thread at nice 0 / nice 19", "unit": "x",
         "value": round(statistics.median(ratios), 3), "target": "", "ok": None,
         "notes": f"windows [{fmt(ratios, 3)}]; medians of steps {WARMUP + 1}..{STEPS}: "
                  f"nice 0 [{fmt([1e3 * x for x in step['0']])}] ms, nice 19 "
                  f"[{fmt([1e3 * x for x in step['19']])}] ms; losses bitwise the same: "
                  f"{same}"},
        {"name": "launch: 2 x 4 job CPU seconds, gloo thread at nice 0 / nice 19",
         "unit": "x", "value": round(statistics.median(cpu_ratios), 3), "target": "",
         "ok": None,
         "notes": f"windows [{fmt(cpu_ratios, 3)}]; both processes from start to exit, "
                  f"{STEPS} steps: nice 0 [{fmt(cpu['0'])}] s, nice 19 [{fmt(cpu['19'])}] s "
                  f"(a gloo message that arrives before its buffer is posted makes gloo's "
                  f"thread spin; at nice 19 it spins in the time the compute threads leave)"},
    ]


def run() -> list[dict[str, Any]]:
    """Launches 1 x 8 and 2 x 4 jobs of the same config; returns the benchmark rows."""
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        # Cold compiles for both: an empty persistent cache that the workers inherit
        # (multi-process CPU workers never use it, see workbench.jobs._worker).
        saved = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(tmp) / "jax-cache")
        try:
            one = _job(Path(tmp), "1x8", 1, 8)
            two = _job(Path(tmp), "2x4", 2, 4)
            gloo = _gloo_priority_rows(Path(tmp))
        finally:
            if saved is None:
                os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
            else:
                os.environ["JAX_COMPILATION_CACHE_DIR"] = saved
    diff = max(abs(a - b) / abs(b) for a, b in zip(one["losses"], two["losses"]))
    ratio = two["step_time_s"] / one["step_time_s"]
    cfg = f"tiny, batch 16, seq 64, {STEPS} steps, synthetic data"
    return [
        {"name": "launch: time to first step, 2 processes x 4 CPU devices", "unit": "s",
         "value": round(two["first_step_s"], 2), "target": "< 60 s", "ok": two["first_step_s"] < 60,
         "notes": f"from wb.launch() to step 1 in metrics.jsonl: process start, jax.distributed "
                  f"join, data, init, compile ({two['compile_s'] and round(two['compile_s'], 2)} s "
                  f"compile); {cfg}"},
        {"name": "launch: time to first step, 1 process x 8 CPU devices", "unit": "s",
         "value": round(one["first_step_s"], 2), "target": "", "ok": None,
         "notes": f"the same without jax.distributed, cold compile cache "
                  f"({one['compile_s'] and round(one['compile_s'], 2)} s compile)"},
        {"name": "launch: step time 1 x 8 (median)", "unit": "ms",
         "value": round(1e3 * one["step_time_s"], 2), "target": "", "ok": None,
         "notes": f"steps {WARMUP + 1}..{STEPS}; {cfg}"},
        {"name": "launch: step time 2 x 4 (median)", "unit": "ms",
         "value": round(1e3 * two["step_time_s"], 2), "target": "", "ok": None,
         "notes": "gloo all-reduces over 127.0.0.1; both processes share the CPU cores"},
        {"name": "launch: step time 2 x 4 / 1 x 8", "unit": "x", "value": round(ratio, 3),
         "target": "", "ok": None,
         "notes": f"no target: on CPU every FSDP all-gather/reduce-scatter of the 2 x 4 job "
                  f"is a gloo TCP round trip between processes sharing the cores; max "
                  f"relative loss difference between the jobs {diff:.1e} (gloo's ring sums "
                  f"in another order than XLA's in-process all-reduce)"},
        *gloo,
    ]


if __name__ == "__main__":  # pragma: no cover
    for row in run():
        print(row)
