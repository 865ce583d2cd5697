"""Stored calibrations: achieved rates of one device kind (``Calibration``), one JSON file
per kind, with their provenance; read (``load_calibration``, damaged files ignored with a
warning), written (``Calibration.save``) and removed (``remove_calibration``), and applied
to a hardware entry (``Calibration.apply_spec``, ``Calibration.collective_seconds``).

The factors are fitted from profiles by ``workbench.perf._calibrate.calibrate`` and are
relative to the hardware entry (``cpu_spec`` divides one host's peak among its simulated
devices: a calibration from 8 devices applies to 4). Which calibration a prediction uses
is decided in one place, ``workbench.hardware.effective_spec``.
Files: ``$WORKBENCH_CALIBRATION`` or ``<cache>/calibration``, one JSON per device kind.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any

from workbench._cache import cache_root, read_cached
from workbench._validate import check_str

__all__ = ["FACTOR_RANGE", "Calibration", "CalibrationWarning", "calibration_dir",
           "check_calibration", "load_calibration", "remove_calibration"]


#: Bytes a calibration file may hold (a few KiB with its provenance and residuals).
_MAX_FILE = 4 << 20

#: The range a fitted factor (achieved rate / the table's) may take: a device that runs
#: 100x past its table's peak or bandwidth, or 10,000x below it, is a broken fit (a
#: profile of the wrong step, a clock that stood still), not a calibration.
FACTOR_RANGE: tuple[float, float] = (1e-4, 100.0)


def calibration_dir() -> Path:
    """Where calibrations are stored: ``$WORKBENCH_CALIBRATION`` or ``<cache>/calibration``."""
    env = os.environ.get("WORKBENCH_CALIBRATION")
    return Path(env) if env else cache_root() / "calibration"


def _file(device_kind: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_kind).strip("-").lower() or "device"
    return calibration_dir() / f"{slug}.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Achieved rates of one device kind, measured from profiles.

    Attributes:
      device_kind: the hardware entry's name (``"H100"``, ``"CPU (AMD EPYC ...)"``).
      compute_factor: achieved matmul FLOP/s / the entry's peak.
      memory_factor: achieved HBM bandwidth / the entry's bandwidth.
      matmul_flops, hbm_bandwidth: the achieved values per device when calibrated.
      collectives: ``{"all-reduce" or "all-reduce@network": {"latency": s, "scale": s,
        "bandwidth": B/s}}``.
      overlap: measured fraction of communication hidden behind local work (None: keep
        the platform's default).
      provenance: the profiles it comes from (directory, plan, mesh, date, JAX version).
      residuals: per profile it was fitted to, its measured step beside the step this
        calibration predicts for it: ``{"directory", "plan_name", "mesh", "measured",
        "predicted"}`` (seconds), the basis of a calibrated prediction's error band
        (``workbench.perf._band``); None in a file stored before they were kept.
    """

    device_kind: str
    compute_factor: float
    memory_factor: float
    matmul_flops: float
    hbm_bandwidth: float
    collectives: dict[str, dict[str, float]]
    overlap: float | None
    provenance: list[dict[str, Any]]
    residuals: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        for key in ("compute_factor", "memory_factor"):
            _factor(getattr(self, key), f"Calibration.{key}")

    @property
    def source(self) -> str:
        """``"calibrated from profile <dir> (<plan>, <mesh>, <date>)"`` (all profiles)."""
        parts = [f"{p['directory']} ({p.get('plan_name') or 'step'}, mesh {p.get('mesh')}, "
                 f"{p.get('date', '?')[:16]})" for p in self.provenance]
        return "calibrated from profile " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """The calibration of a stored dict, checked (:func:`check_calibration`).

        Raises:
          ValueError: a field missing, of the wrong type, out of range or not finite
            (named, with its value).
        """
        return cls(**check_calibration(d))

    def save(self) -> Path:
        """Writes the calibration for its device kind (replacing an older one: a regular
        file; anything else at its path, or a calibration folder that is a run directory,
        is refused with a ValueError and left as it is). Written to a temporary file of
        its own, then renamed over the old one."""
        path = _file(self.device_kind)
        _check_place(path, "written")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_dict(), indent=1))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    # -- applying it -----------------------------------------------------------------
    def apply_spec(self, spec: Any) -> Any:
        """``spec`` with the achieved FLOP/s and HBM bandwidth."""
        src = dict(spec.sources or {})
        src["hbm_bandwidth"] = f"{self.source}: {self.memory_factor:.3g} x " + \
            src.get("hbm_bandwidth", "the table's")
        return dataclasses.replace(
            spec, peak_flops=spec.peak_flops * self.compute_factor,
            hbm_bandwidth=(spec.hbm_bandwidth or 0.0) * self.memory_factor,
            source=f"{self.source}: {self.compute_factor:.3g} x ({spec.source})", sources=src)

    def collective_seconds(self, kind: str, network: bool, seconds: float, count: int,
                           table_latency: float) -> tuple[float, bool]:
        """A collective's calibrated time from its table time, and whether a factor of
        its kind was found."""
        f = self.collectives.get(f"{kind}@network" if network else kind)
        if f is None:
            return seconds, False
        bw_part = max(0.0, seconds - count * table_latency)
        return count * f["latency"] + f["scale"] * bw_part, True


def _number(d: dict[str, Any], key: str, where: str, *, low: float = 0.0,
            positive: bool = False, inf: bool = False) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or \
            (math.isinf(v) and not inf) or v < low or (positive and v <= low):
        bound = f"> {low:g}" if positive else f">= {low:g}"
        raise ValueError(f"{where}{key} is {v!r}, not a {'' if inf else 'finite '}number "
                         f"{bound}")
    return float(v)


def _factor(v: Any, name: str) -> float:
    """``v`` if a number within :data:`FACTOR_RANGE`, else a ValueError naming it."""
    low, high = FACTOR_RANGE
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise ValueError(f"{name} is {v!r}, not a factor in [{low:g}, {high:g}] (achieved "
                         "rate / the hardware table's); calibrate again from a profile of "
                         "the step (wb.calibrate(trainer.profile()))")
    return float(v)


def check_calibration(d: Any) -> dict[str, Any]:
    """The fields of a stored calibration, checked: the factors within
    :data:`FACTOR_RANGE`, the
    achieved rates and latencies finite and >= 0, ``collectives`` an object of kind ->
    ``{"latency", "scale", "bandwidth"}`` (bandwidth may be inf: scale 0), ``overlap``
    None or in [0, 1], ``provenance`` a list of objects with a ``directory``.

    Raises:
      ValueError: naming the first bad field and its value.
    """
    if not isinstance(d, dict):
        raise ValueError(f"it holds a JSON {type(d).__name__}, not an object")
    missing = [f.name for f in dataclasses.fields(Calibration)
               if f.name not in d and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"fields {missing} are missing")
    if not isinstance(d["device_kind"], str) or not d["device_kind"]:
        raise ValueError(f"device_kind is {d['device_kind']!r}, not a device kind's name")
    out = {"device_kind": d["device_kind"]}
    for key in ("compute_factor", "memory_factor"):
        out[key] = _factor(_number(d, key, "", positive=True), key)
    for key in ("matmul_flops", "hbm_bandwidth"):
        out[key] = _number(d, key, "")
    colls = d["collectives"]
    if not isinstance(colls, dict):
        raise ValueError(f"collectives is {_short(colls)}, not an object of collective kind "
                         "-> factors")
    out["collectives"] = {}
    for kind, f in colls.items():
        if not isinstance(f, dict):
            raise ValueError(f"collectives[{kind!r}] is {_short(f)}, not an object")
        where = f"collectives[{kind!r}]."
        out["collectives"][kind] = {
            **{k: v for k, v in f.items() if k not in ("latency", "scale", "bandwidth")},
            "latency": _number(f, "latency", where), "scale": _number(f, "scale", where),
            "bandwidth": _number(f, "bandwidth", where, inf=True)}
    overlap = d["overlap"]
    if overlap is not None:
        out["overlap"] = _number(d, "overlap", "")
        if out["overlap"] > 1:
            raise ValueError(f"overlap is {overlap!r}, not a fraction in [0, 1]")
    else:
        out["overlap"] = None
    prov = d["provenance"]
    if not isinstance(prov, list) or not all(
            isinstance(p, dict) and isinstance(p.get("directory"), str)
            and isinstance(p.get("date", ""), str) for p in prov):
        raise ValueError(f"provenance is {_short(prov)}, not a list of objects with a "
                         "'directory' (and a 'date' string)")
    out["provenance"] = prov
    out["residuals"] = _residuals(d.get("residuals"))
    return out


def _residuals(res: Any) -> list[dict[str, Any]] | None:
    """A stored calibration's residuals checked: None (a file from before they were
    kept), or a list of objects whose ``measured`` and ``predicted`` are finite seconds
    > 0."""
    if res is None:
        return None
    if not isinstance(res, list) or not all(isinstance(r, dict) for r in res):
        raise ValueError(f"residuals is {_short(res)}, not a list of objects with the "
                         "'measured' and 'predicted' step seconds of each profile")
    for i, r in enumerate(res):
        for key in ("measured", "predicted"):
            _number(r, key, f"residuals[{i}].", positive=True)
    return [dict(r) for r in res]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class CalibrationWarning(UserWarning):
    """A stored calibration file that cannot be used; predictions go on without it."""


def load_calibration(device_kind: str) -> Calibration | None:
    """The stored calibration of ``device_kind``, or None.

    A file that cannot be used (truncated, empty, binary, not an object, a directory, a
    pipe, a symlink out of its folder, over 4 MiB, another device kind's calibration, a
    value of the wrong type, out of range or not finite) is ignored with a
    :class:`CalibrationWarning` naming it, what is wrong and the fix; it never raises, so
    one bad file cannot break every later ``wb.plan``.
    """
    path = _file(device_kind)
    raw, why = read_cached(path, inside=path.parent, max_bytes=_MAX_FILE)
    if raw is None:   # none; or a directory, a pipe, a symlink out, too large, no permission
        return _ignored(path, device_kind, why) if why else None
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as e:
        return _ignored(path, device_kind, f"not UTF-8 text (byte {e.start}; binary?)")
    except (ValueError, RecursionError) as e:
        why = "empty" if not raw.strip() else f"not valid JSON ({e})"
        return _ignored(path, device_kind, why)
    try:
        cal = Calibration.from_dict(data)
    except ValueError as e:
        return _ignored(path, device_kind, str(e))
    if cal.device_kind != device_kind:   # copied from another kind's file
        return _ignored(path, device_kind, f"it is the calibration of {cal.device_kind!r}, "
                        f"not of {device_kind!r}")
    return cal


def _ignored(path: Path, device_kind: str, why: str) -> None:
    warnings.warn(
        f"calibration file {path} is ignored: {why}. Predictions for {device_kind!r} use "
        f"the hardware table. Calibrate again (wb.calibrate(trainer.profile())) or remove "
        f"it (wb.remove_calibration({device_kind!r}), or delete the file)",
        CalibrationWarning, stacklevel=3)
    return None


def remove_calibration(device_kind: str) -> bool:
    """Deletes the stored calibration of ``device_kind``; True if there was one.

    Only a regular file is removed (damaged or not: the fix a bad file's warning gives).

    Raises:
      ValueError: its path is a directory, a symlink, a pipe or device (not a file
        ``wb.calibrate`` wrote), or the calibration folder is a run directory (its
        ``run.json`` is never a calibration): it is left as it is, for you to look at.
      TypeError: ``device_kind`` is not a string.
    """
    check_str(device_kind, "device_kind", where="remove_calibration: ",
              example="'H100 SXM', the name wb.calibrate(...).device_kind gives")
    path = _file(device_kind)
    _check_place(path, "removed")
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _check_place(path: Path, verb: str) -> None:
    """Refuses to write or remove ``path`` when it is not a calibration file's place: the
    folder is a run directory, or something other than a regular file is there."""
    from workbench._runs import RUN_JSON

    if os.path.lexists(path.parent / RUN_JSON):
        raise ValueError(f"the calibration folder {path.parent} is a run directory (it holds "
                         f"{RUN_JSON}); nothing was {verb}: point WORKBENCH_CALIBRATION at a "
                         "folder of its own")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    what = ("a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode)
            else "a pipe or device")
    raise ValueError(f"{path} is {what}, not a calibration file that wb.calibrate wrote; "
                     f"nothing was {verb}: look at it and remove it yourself")
