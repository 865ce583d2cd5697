"""``python -m benchmarks``: what a run of some modules writes into results.json and
BENCHMARKS.md, and what it keeps."""
from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))
import benchmarks.__main__ as bm  # noqa: E402

HERE = {"machine": "here", "when": "2026-01-02T00:00:00+00:00"}
EARLIER = {"machine": "here", "when": "2026-01-01T00:00:00+00:00"}


def _setup(tmp_path, monkeypatch, rows):
    results, md = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    results.write_text(json.dumps(rows))
    monkeypatch.setattr(bm, "RESULTS", results)
    monkeypatch.setattr(bm, "OUT", md)
    monkeypatch.setattr(bm, "_machine", lambda: "here")
    monkeypatch.setattr(bm, "_modules", lambda: ["bench_a", "bench_b"])
    return results, md


def test_a_module_run_keeps_rows_another_run_wrote_meanwhile(tmp_path, monkeypatch):
    """Two runs of different modules overlapping in time: the one ending last still
    keeps the other's rows (results.json is read after its own modules ran)."""
    results, md = _setup(tmp_path, monkeypatch, [
        {"name": "a old", "value": 1, "module": "bench_a", "measured": EARLIER},
        {"name": "b old", "value": 1, "module": "bench_b", "measured": EARLIER}])

    def run_one(name):   # bench_b's own run ends while bench_a runs
        results.write_text(json.dumps([
            {"name": "a old", "value": 1, "module": "bench_a", "measured": EARLIER},
            {"name": "b new", "value": 2, "module": "bench_b", "measured": HERE}]))
        return [{"name": "a new", "value": 3, "module": name, "measured": HERE}]

    monkeypatch.setattr(bm, "_run_one", run_one)
    assert bm.main(["bench_a"]) == 0
    rows = {r["name"]: r["value"] for r in json.loads(results.read_text())}
    assert rows == {"a new": 3, "b new": 2}
    assert "| bench_b | b new | 2 |" in md.read_text()


def test_provenance_names_every_time_a_modules_rows_were_measured():
    lines = bm._provenance([
        {"module": "bench_a", "measured": HERE}, {"module": "bench_a", "measured": EARLIER},
        {"module": "bench_b"}, {"module": "bench_c", "measured": HERE}, {"module": "bench_c"}])
    assert lines == [
        f"- bench_a: here, {HERE['when']} (some rows {EARLIER['when']}).",
        "- bench_b: not recorded (measured before rows kept their machine).",
        f"- bench_c: here, {HERE['when']}. Some rows not recorded."]
