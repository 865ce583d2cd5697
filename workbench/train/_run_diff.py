"""What differs between the run a directory holds and the one given now: config and data.

Pure comparisons of records (``run.json``'s ``config`` and ``data`` against a
``TrainConfig`` and ``ShardedBatches.info``), no file read or written: the checks that act
on the differences (refuse, fork, or accept and record) are
:func:`workbench.train._setup.check_run_dir` and :func:`workbench.train._setup.check_data`.
"""
from __future__ import annotations

from typing import Any

from workbench.train._config import RUN_CONTROL_FIELDS, TrainConfig


def identity_fields(config: TrainConfig) -> tuple[str, ...]:
    """Fields that may differ when continuing a run: cadence, retention, the mesh layout,
    and ``steps`` when the learning-rate schedule does not depend on it."""
    if config.optimizer.decay_steps is not None:
        return (*RUN_CONTROL_FIELDS, "steps")
    return RUN_CONTROL_FIELDS


def config_diff(stored: dict[str, Any], config: TrainConfig, *,
                recorded_dtype: str | None = None) -> dict[str, tuple[Any, Any]]:
    """Differences that matter between a stored config (dict) and ``config``.

    ``model.dtype`` compares what the step computes in: a run recorded with "float32" (the
    default before "auto") continues under "auto" where "auto" resolves to float32 (on CPU),
    and a run recorded under "auto" continues with the dtype it resolved to
    (``recorded_dtype``, run.json's ``dtype``)."""
    try:
        old = TrainConfig.from_dict(stored)
    except (TypeError, ValueError) as e:
        return {"config": (f"unreadable: {e}", "given")}
    skip = set(identity_fields(old)) & set(identity_fields(config))
    diff = {k: v for k, v in old.diff(config).items() if k.split(".")[0] not in skip}
    dtype_keys = [k for k in ("model.dtype", "model_overrides.dtype") if k in diff]
    if dtype_keys and _same_compute_dtype(old, config, recorded_dtype):
        for k in dtype_keys:
            del diff[k]
    return diff


def _same_compute_dtype(stored: TrainConfig, given: TrainConfig, recorded: str | None
                        ) -> bool:
    """Whether the stored run's model (whose dtype resolved to ``recorded``, if known) and
    the given one on this process's platform compute in the same dtype."""
    from workbench.models._config import current_platform, resolve_dtype

    try:
        old, new = (getattr(c.model_config(), "dtype", None) for c in (stored, given))
    except Exception:  # noqa: BLE001 - a model that cannot be built here differs anyway
        return False
    if not (isinstance(old, str) and isinstance(new, str)) or "auto" not in (old, new):
        return False
    platform = current_platform()
    if old == "auto":
        old = recorded or resolve_dtype(old, platform)[0]
    return old == resolve_dtype(new, platform)[0]


#: What identifies the data a run trains on (``run.json``'s ``data``), compared on resume:
#: the documents' combined hash (which includes the tokenizer's fingerprint), the eval
#: files', the tokenizer's fingerprint and its vocabulary.
DATA_IDENTITY = ("sha256", "eval_sha256", "tokenizer_fingerprint", "vocab_size")


def _short(sha: Any) -> str:
    return str(sha)[:12] if sha else "none"


def _file_changes(old: Any, new: Any, what: str) -> list[str]:
    """Lines naming the files added, removed or changed between two ``{path: sha256}``."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        out.append(f"{what} {path}: " + ("added" if a is None else "removed" if b is None
                   else f"content changed (sha256 {_short(a)} -> {_short(b)})"))
    return out


def _hub_change(old: Any, new: Any) -> list[str]:
    """A line naming the commits of a Hub dataset whose split's files changed."""
    if not isinstance(old, dict) or not isinstance(new, dict) or \
            old.get("commit") == new.get("commit"):
        return []
    return [f"Hub dataset {new.get('id')!r} split {new.get('split')!r}: commit "
            f"{_short(old.get('commit'))} -> {_short(new.get('commit'))}"]


def data_diff(stored: Any, info: dict[str, Any]) -> list[str]:
    """What differs between the data a run recorded (``run.json``'s ``data``) and ``info``
    (``ShardedBatches.info``), one line each; empty when they are the same.

    Only identity fields present in both are compared (a run recorded before a field
    existed is compared on the others).
    """
    if not isinstance(stored, dict) or stored.get("kind") != info.get("kind"):
        return []   # another kind of data is a config change (TrainConfig.data)
    same = all(stored[k] == info[k] for k in DATA_IDENTITY if k in stored and k in info)
    if same:
        return []
    lines = _hub_change(stored.get("hf"), info.get("hf")) + \
        _file_changes(stored.get("file_sha256"), info.get("file_sha256"), "file") + \
        _file_changes(stored.get("eval_file_sha256"), info.get("eval_file_sha256"),
                      "eval file")
    tok = (info.get("tokenizer") or {}).get("path") or "byte-level"
    if stored.get("tokenizer_sha256", info.get("tokenizer_sha256")) != \
            info.get("tokenizer_sha256"):
        lines.append(f"tokenizer {tok}: the file changed (sha256 "
                     f"{_short(stored['tokenizer_sha256'])} -> "
                     f"{_short(info.get('tokenizer_sha256'))})")
    elif stored.get("tokenizer_fingerprint", info.get("tokenizer_fingerprint")) != \
            info.get("tokenizer_fingerprint"):
        lines.append(f"tokenizer {tok}: its special tokens changed (fingerprint "
                     f"{stored['tokenizer_fingerprint']} -> {info.get('tokenizer_fingerprint')})")
    if stored.get("vocab_size", info.get("vocab_size")) != info.get("vocab_size"):
        lines.append(f"vocab_size: {stored['vocab_size']} -> {info.get('vocab_size')}")
    if not lines:   # a run recorded before the per-file hashes: the combined one
        for k in ("sha256", "eval_sha256"):
            if k in stored and k in info and stored[k] != info[k]:
                what = "the eval files" if k == "eval_sha256" else "the documents"
                lines.append(f"{what}: their combined hash changed (sha256 "
                             f"{_short(stored[k])} -> {_short(info[k])})")
    return lines

