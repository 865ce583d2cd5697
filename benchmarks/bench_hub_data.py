"""A Hub dataset's split read two ways, on a locally built Hugging Face cache (offline).

- Cache: ``datasets--bench--text`` laid out as ``huggingface_hub`` writes it (blobs,
  snapshot symlinks, ``refs/main``), a ``train`` and a ``validation`` split of
  ``SPLIT_MB`` MB of Parquet each (the standard library's ``.py`` files as documents).
- ``datasets.load_dataset(snapshot, split="train")``, then the text column iterated: what
  the ``datasets`` route reads and writes before and while handing out documents (it
  converts the config's splits to Arrow files in its own cache first).
- ``wb.data.Dataset(hf=...)``'s route (``workbench.data._hub_dataset``): the same resolver
  (``datasets.load_dataset_builder`` on the snapshot), then the token cache's reads: one
  SHA-256 pass over the split's files (its identity) and the documents read row group by
  row group with pyarrow. Tokenizing and writing the token cache are the same either way
  and left out.

Bytes are the process's ``rchar`` / ``wchar`` (``/proc/self/io``: bytes passed through
read/write system calls, page cache included), so they do not depend on the machine's
speed; each route runs in a fresh process. Both must yield the same documents.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

SPLIT_MB = 24
REPO, WARM, COMMIT = "bench/text", "bench/warm-up", "c" * 40


def _docs(limit: int) -> list[str]:
    docs, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text)
        if total >= limit:
            break
    return docs


def build_cache(hub: Path, split_mb: float = SPLIT_MB, repo_id: str = REPO) -> Path:
    """``repo_id`` in the Hub cache under ``hub``; returns its snapshot folder."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = hub / ("datasets--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    hub.mkdir(parents=True, exist_ok=True)
    docs = _docs(int(2 * split_mb * 1e6))
    half = len(docs) // 2
    for split, part in (("train", docs[:half]), ("validation", docs[half:])):
        tmp = hub / f"{split}.parquet"
        pq.write_table(pa.table({"text": part}), tmp, row_group_size=256)
        data = tmp.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, blob)
        link = snap / "data" / f"{split}-00000-of-00001.parquet"
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {k: int(fields[k]) for k in ("rchar", "wchar")}


def _datasets_route(repo_id: str) -> tuple[int, int]:
    """``(documents, bytes of Arrow files it maps)``: load_dataset, then the text column."""
    import datasets

    snap = Path(os.environ["HF_HUB_CACHE"], "datasets--" + repo_id.replace("/", "--"),
                "snapshots", COMMIT)
    ds = datasets.load_dataset(str(snap), split="train")
    return sum(1 for t in ds["text"] if t), sum(Path(f["filename"]).stat().st_size
                                                for f in ds.cache_files)


def _hub_route(repo_id: str) -> tuple[int, int]:
    """``(documents, 0)``: the split resolved, hashed once, its row groups read."""
    import hashlib

    from workbench.data._files import read_unit, units
    from workbench.data._hub_dataset import resolve_split

    docs = 0
    for path in resolve_split(repo_id, split="train").files:
        with open(path, "rb") as f:       # the token cache's identity: one SHA-256 pass
            hashlib.file_digest(f, "sha256")
        for unit in units(Path(path), "parquet"):
            docs += sum(1 for t in read_unit(unit, "text") if t)
    return docs, 0


def measure(route: str) -> dict[str, Any]:
    """One route in this process (the environment names the cache), after the same route
    on a small warm-up dataset (so imports are not counted): bytes and documents."""
    read = _datasets_route if route == "datasets" else _hub_route
    read(WARM)
    before = _io()
    docs, mapped = read(REPO)
    after = _io()
    arrow = sum(f.stat().st_size for f in Path(os.environ["HF_HOME"], "datasets")
                .rglob("*.arrow") if WARM.split("/")[1] not in str(f)) \
        if route == "datasets" else 0
    return {"read": after["rchar"] - before["rchar"], "wrote": after["wchar"] - before["wchar"],
            "arrow": arrow, "mapped": mapped, "docs": docs}


def _child(route: str, env: dict[str, str]) -> dict[str, Any]:
    code = ("import json, sys; from benchmarks.bench_hub_data import measure; "
            f"print(json.dumps(measure({route!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(split_mb: float = SPLIT_MB) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        snap = build_cache(hf / "hub", split_mb)
        build_cache(hf / "hub", 0.05, WARM)
        split_bytes = (snap / "data/train-00000-of-00001.parquet").resolve().stat().st_size
        env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub"),
               "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "BENCH_SNAPSHOT": str(snap), "WORKBENCH_CACHE": str(Path(tmp) / "wb")}
        got = {route: _child(route, env) for route in ("datasets", "hub+parquet")}
    assert got["datasets"]["docs"] == got["hub+parquet"]["docs"], got
    mb = lambda n: round(n / 1e6, 1)
    rows = []
    for route, label in (("datasets", "datasets.load_dataset"),
                         ("hub+parquet", "huggingface_hub + Parquet (Dataset(hf=))")):
        g = got[route]
        rows.append({"name": f"Hub split read, {label}", "value": mb(g["read"]), "unit": "MB read",
                     "target": "", "ok": None,
                     "notes": f"{mb(g['wrote'])} MB written, {mb(g['mapped'])} MB of Arrow "
                              f"mapped (not in MB read); train split {mb(split_bytes)} MB of "
                              f"Parquet (validation the same), {g['docs']} documents"})
    return rows


if __name__ == "__main__":
    print(json.dumps(run(float(sys.argv[1]) if len(sys.argv) > 1 else SPLIT_MB), indent=1))
