"""Exercises: every one fed right and wrong answers, verdicts compared with JAX's own answers."""
import math

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import workbench as wb
from workbench.exercises import _core, exercises
from workbench.exercises._sharding import concrete_mesh

# name -> (right answers, [(wrong answer, phrase its explanation must contain)]).
# Right/wrong is decided by hand here; the exercise computes its verdict with JAX.
CASES = {
    "mesh_for_block": (["data=4, model=2", {"data": 4, "model": 2}, "{'model': 2, 'data': 4}"],
                       [("data=2, model=4", "(16, 1024)"), ("data=8, model=2", "16 devices"),
                        ("fsdp=4, tp=2", "exactly the axes")]),
    "tp_within_host": (["data=2, model=8"],
                       [("model=8, data=2", "hosts [0, 1]"), ("data=4, model=4", "not the largest"),
                        ("data=1, model=16", "hosts [0, 1]"), ("data=3, model=5", "needs 15")]),
    "spec_for_block": (["P('data', None, 'model')", "PartitionSpec('model', None, 'data')",
                        P("data", None, "model"), ("data", None, "model")],
                       [("P('data', 'model')", "dim 1 (size 2048): you split it 8 ways"),
                        ("P('data', None, 'model', None)", "matches tensor dims, not mesh dims"),
                        ("P(('data', 'model'), None, None)", "64 ways"),
                        ("P('dat', None, 'model')", "did you mean 'data'"),
                        ("P(data, None, model)", "in quotes")]),
    "device_block": (["x[8:12, 4:8]", "[8:12, 4:8]", ((8, 12), (4, 8))],
                     [("x[8:12, 0:4]", "dim 1: 0:4 is wrong"), ("x[4:8, 4:8]", "number 2 along 'data'"),
                      ("x[8:12]", "give 2 ranges")]),
    "replication": (["4", 4], [("2", "distinct blocks"), ("8", "every device")]),
    "vocab_padding": (["50304"], [("50264", "not a multiple of 8"), ("50258", "JAX refuses"),
                                  ("50368", "not the smallest"), ("50000", ">= 50257")]),
    "fsdp_collective": (["all-gather", "AllGather", "all_gather"],
                        [("all-reduce", "partial sum"), ("none", "exchange"),
                         ("broadcast", "not one of")]),
    "repeated_work": (["P('data', None)", "P(('data', 'model'), None)", "P('data', 'model')"],
                      [("P('model', None)", "4 times over"), ("P(None, None)", "4 times over"),
                       ("P('data', None, None)", "rank 2")]),
    "megatron_mlp": (["up=P(None, 'model'), down=P('model', None)",
                      "P(None, 'model'), P('model', None)"],
                     [("up=P('model', None), down=P(None, 'model')", "2 collective(s)"),
                      ("up=P(None, 'model'), down=P(None, 'model')", "all-gather"),
                      ("up=P(None, None), down=P(None, None)", "1 piece(s)"),
                      ("up=P(None, 'model')", "exactly once")]),
    "adam_state_bytes": (["576 MiB", "576", "0.5625 GiB", 576],
                         [("288 MiB", "one moment"), ("4608", "unsharded"),
                          ("604", "MB (10^6 bytes)"), ("1 furlong", "unknown unit"),
                          ("100", "Count the moments")]),
    "megacore_devices": (["16"], [("32", "TensorCores"), ("4", "local_devices")]),
    "ironwood_devices": (["128"], [("64", "counts chips"), ("8", "local_devices"),
                                   ("256", "already counts TensorCores")]),
    "host_batch": (["64"], [("256", "global batch"), ("16", "one chip's share")]),
    "pipeline_bubble": (["0.3333", "33.33%", "3/9"],
                        [("1/2", "relative to the useful time"), ("2/3", "busy share"),
                         ("1/4", "share of the layers")]),
    "stage_block_bytes": (["240.5", "0.2349 MiB"],
                          [("481 KiB", "forgets fsdp"), ("962 KiB", "only its 2 of the 8"),
                           ("1924 KiB", "every layer")]),
    "ring_kv_bytes": (["448 MiB", "0.4375 GiB"],
                      [("512 MiB", "already has its own"), ("224 MiB", "K or V alone"),
                       ("3584 MiB", "kv heads"), ("896 MiB", "float32")]),
    "moe_all_to_all_axis": (["expert", "'expert'"], [("data", "splits the batch")]),
    "moe_dispatch_bytes": (["80 MiB", "0.078125 GiB"],
                           [("160 MiB", "float32"), ("64 MiB", "capacity factor"),
                            ("10 MiB", "one expert")]),
}


def test_registry_has_enough_exercises_across_notebooks():
    names = [e.name for e in exercises()]
    assert sorted(names) == sorted(CASES)
    assert len(names) >= 8
    assert {e.notebook for e in exercises()} >= {"01", "02", "03", "04", "07"}
    assert [e.name for e in exercises("02_partition_specs")] == [
        "spec_for_block", "device_block", "replication", "vocab_padding", "fsdp_collective",
        "repeated_work"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_right_answers_are_correct(name):
    ex = wb.exercise(name)
    rights, _ = CASES[name]
    for answer in [ex.solution, *rights]:
        result = ex.check(answer)
        assert result.correct, (answer, result.explanation)
        assert result.explanation and not result.hint
        assert bool(result) is True


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrong_answers_are_explained(name):
    ex = wb.exercise(name)
    _, wrongs = CASES[name]
    for answer, phrase in wrongs:
        result = ex.check(answer)
        assert not result.correct, answer
        assert phrase in result.explanation, (answer, result.explanation)
        assert result.hint, answer
        assert "not yet" in str(result)


def test_empty_answer_says_how_to_write_one():
    result = wb.exercise("spec_for_block").check("   ")
    assert not result.correct and "P('data', None, 'model')" in result.explanation


def test_unknown_exercise_suggests_a_name():
    with pytest.raises(KeyError, match="did you mean 'spec_for_block'"):
        wb.exercise("spec_for_blocks")


_ENTRIES = st.sampled_from([None, "data", "model", ("data", "model"), ("model", "data")])


@settings(max_examples=60, deadline=None)
@given(st.lists(_ENTRIES, min_size=0, max_size=3))
def test_spec_for_block_agrees_with_jax_shard_shape(entries):
    """The verdict is 'correct' exactly when JAX's shard_shape is the target block."""
    names = [a for e in entries if e for a in ((e,) if isinstance(e, str) else e)]
    spec = P(*entries)
    result = wb.exercise("spec_for_block").check(spec)
    if len(names) != len(set(names)):
        assert not result.correct and "may split at most one dim" in result.explanation
        return
    mesh = AbstractMesh((8, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    block = NamedSharding(mesh, spec).shard_shape((64, 2048, 12288))
    assert result.correct == (tuple(block) == (8, 2048, 1536)), (spec, result.explanation)
    if not result.correct:
        assert str(tuple(block)) in result.explanation


@settings(max_examples=20, deadline=None)
@given(st.integers(50257, 50257 + 300))
def test_vocab_padding_agrees_with_jax(vocab):
    mesh = AbstractMesh((8,), ("model",), axis_types=(AxisType.Auto,))
    try:
        rows = NamedSharding(mesh, P("model", None)).shard_shape((vocab, 768))[0]
        fits = rows % 8 == 0
    except ValueError:
        fits = False
    smallest = min(v for v in range(50257, 50257 + 300) if v % 64 == 0)
    assert wb.exercise("vocab_padding").check(str(vocab)).correct == (fits and vocab == smallest)


def test_device_block_matches_devices_indices_map_for_every_device():
    """The expected slice is JAX's own for the asked position; other devices' slices are wrong."""
    mesh = concrete_mesh(data=4, model=2)
    ex = wb.exercise("device_block")
    index_map = NamedSharding(mesh, P("data", "model")).devices_indices_map((16, 8))
    verdicts = {}
    for dev, idx in index_map.items():
        text = "x[" + ", ".join(f"{s.start}:{s.stop}" for s in idx) + "]"
        verdicts[dev.id] = ex.check(text).correct
    assert sum(verdicts.values()) == 1 and verdicts[mesh.devices[2, 1].id]


def test_fsdp_and_megatron_verdicts_follow_the_compiled_hlo():
    """Hand-checkable facts about the two programs, read from JAX independently."""
    mesh = concrete_mesh(data=8)
    x = jax.ShapeDtypeStruct((64, 256), "float32", sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((256, 512), "float32", sharding=NamedSharding(mesh, P("data", None)))
    text = jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text()
    assert "all-gather" in text and "all-reduce(" not in text
    r = wb.exercise("fsdp_collective").check("all-gather")
    assert r.correct and f"{2 * 64 * 256 * 512 // 8:,} FLOPs per device" in r.explanation


def test_adam_state_counts_optax_moments():
    import optax
    state = jax.eval_shape(optax.adam(1e-4).init, jax.ShapeDtypeStruct((12288, 49152), "float32"))
    moments = [x for x in jax.tree.leaves(state) if x.shape == (12288, 49152)]
    mib = sum(math.prod(x.shape) * x.dtype.itemsize for x in moments) / 8 / 2**20
    assert len(moments) == 2 and mib == 576
    assert wb.exercise("adam_state_bytes").check(f"{mib} MiB").correct


def test_parsers():
    assert _core.parse_spec("P('a', None, ('b', 'c'))") == P("a", None, ("b", "c"))
    assert _core.parse_spec("jax.sharding.PartitionSpec('a')") == P("a")
    assert _core.parse_spec("'a'") == P("a")
    with pytest.raises(_core.AnswerError, match="in quotes"):
        _core.parse_spec("P(a)")
    with pytest.raises(_core.AnswerError, match="write it like"):
        _core.parse_spec("P('a'")
    assert _core.parse_axes("data=4, model=2") == {"data": 4, "model": 2}
    with pytest.raises(_core.AnswerError, match="integer"):
        _core.parse_axes("data=4.5")
    assert _core.parse_number("MiB")("1.5 GiB") == 1536
    assert _core.parse_number("MiB")("1,024") == 1024
    assert _core.parse_choice(("all-gather", "none"))("All Gather") == "all-gather"
    assert _core.parse_ranges("y[0:4,4:8]") == ((0, 4), (4, 8))
    specs = _core.parse_specs(("up", "down"))
    assert specs("down=P('m', None), up=P(None, 'm')") == {"up": P(None, "m"), "down": P("m", None)}
    with pytest.raises(_core.AnswerError, match="exactly once"):
        specs("up=P(), left=P()")


def test_concrete_mesh_too_large_says_how_to_fix():
    with pytest.raises(RuntimeError, match=r"wb.simulate_devices\(16\)"):
        concrete_mesh(data=16)


# ---------------------------------------------------------------------------
# The widget: the browser's "check" message goes through the kernel's real check.
# ---------------------------------------------------------------------------


def test_widget_checks_messages_from_the_browser():
    from workbench.widgets._exercise_view import ExerciseView

    ex = wb.exercise("replication")
    view = ExerciseView(ex)
    assert (view.name, view.title, view.prompt) == (ex.name, ex.title, ex.prompt)
    view._on_message(view, {"type": "check", "answer": "2"}, [])
    assert (view.status, view.attempts, view.answer) == ("wrong", 1, "2")
    assert "distinct blocks" in view.explanation and view.hint == ex.hint
    view._on_message(view, {"type": "check", "answer": "4"}, [])
    assert (view.status, view.attempts, view.hint) == ("correct", 2, "")
    assert view.result is not None and view.result.correct
    view._on_message(view, {"type": "other"}, [])
    assert view.attempts == 2


def test_exercise_displays_as_widget_and_prints_as_text(monkeypatch):
    import workbench._display

    ex = wb.exercise("spec_for_block")
    assert ex._repr_mimebundle_() == {"text/plain": repr(ex)}  # a terminal: text only
    monkeypatch.setattr(workbench._display, "in_notebook", lambda: True)
    data, _ = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and data["text/plain"] == repr(ex)
    assert "(64, 2048, 12288)" in str(ex) and "P('data', None, 'model')" in str(ex)
    view = ex.widget()
    assert "export default" in view._esm and ".wb-exercise" in view._css


_NODE_SCRIPT = """
import { pathToFileURL } from "node:url";
import { byClass, fakeModel, installDom } from "%(fake_dom)s";
installDom();
const mod = await import(pathToFileURL("%(module)s").href);
const model = fakeModel(%(state)s);
model.sent = [];
model.send = (msg) => model.sent.push(msg);
const host = document.createElement("div");
const cleanup = mod.default.render({ model, el: host });
const q = (cls) => byClass(host, cls)[0];
const seen = [];
const snap = () => seen.push({status: q("wb-exercise").getAttribute("data-status"),
  verdict: q("wb-ex-verdict").textContent, explanation: q("wb-ex-explanation").textContent,
  hint: q("wb-ex-hint").textContent, disabled: !!q("wb-ex-check").disabled});
snap();
q("wb-ex-input").value = "P('data', 'model')";
q("wb-ex-check").dispatch("click");
snap();
model.set("explanation", "dim 1 is wrong"); model.set("hint", "split dim 2");
model.set("attempts", 2); model.set("status", "wrong");
snap();
q("wb-ex-input").value = "P('data', None, 'model')";
q("wb-ex-input").dispatch("keydown", { key: "Enter", preventDefault() {} });
model.set("status", "correct");
snap();
cleanup();
const left = Object.values(model.handlers).reduce((a, h) => a + h.length, 0);
process.stdout.write(JSON.stringify({ seen, sent: model.sent, saved: model.saved.length, left,
  prompt: q("wb-ex-prompt").textContent, code: byClass(host, "wb-ex-code").length }));
"""


def test_widget_front_end_sends_answers_and_shows_verdicts(tmp_path):
    """exercise.js (as anywidget loads it) under node with the widgets' fake DOM."""
    import json
    import pathlib
    import shutil
    import subprocess

    from workbench.widgets import _assets

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    ex = wb.exercise("fsdp_collective")
    module = tmp_path / "exercise.mjs"
    module.write_text(_assets.esm("exercise"))
    state = {"name": ex.name, "title": ex.title, "prompt": ex.prompt,
             "placeholder": ex.placeholder, "answer": "", "status": "", "explanation": "",
             "hint": "", "attempts": 0}
    fake_dom = pathlib.Path(__file__).parent / "widgets_js" / "fake_dom.mjs"
    script = tmp_path / "run.mjs"
    script.write_text(_NODE_SCRIPT % {"fake_dom": fake_dom.as_uri(), "module": module,
                                      "state": json.dumps(state)})
    out = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    first, checking, wrong, right = r["seen"]
    assert first["status"] == "" and first["explanation"] == "" and not first["disabled"]
    assert checking["status"] == "checking" and checking["disabled"]
    assert r["sent"] == [{"type": "check", "answer": "P('data', 'model')"},
                         {"type": "check", "answer": "P('data', None, 'model')"}]
    assert wrong["verdict"].startswith("✗ not yet (attempt 2)")
    assert wrong["explanation"] == "dim 1 is wrong" and wrong["hint"] == "hint: split dim 2"
    assert right["verdict"] == "✓ correct" and right["hint"] == ""
    assert r["saved"] == 2 and r["left"] == 0
    assert r["code"] == 1 and "Which collective" in r["prompt"]


def test_exercises_are_headless():
    """The core of the exercises imports no display library (the widget comes on display)."""
    import subprocess
    import sys

    code = ("import importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('IPython', 'ipywidgets', 'anywidget', 'plotly'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import workbench as wb\n"
            "print(wb.exercise('replication').check('4').correct)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.browser
def test_exercise_round_trip_in_jupyterlab(lab, browser):
    """Type an answer in the real widget, press Check / Enter: the kernel's verdict shows."""
    import json

    from jupyterlab_harness import run_notebook, screenshot

    source = "import workbench as wb\nwb.simulate_devices(8)\nwb.exercise('repeated_work')"
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "c0", "metadata": {},
                     "outputs": [], "source": source}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = lab.root_dir / "exercise.ipynb"
    path.write_text(json.dumps(nb))
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    try:
        run_notebook(page, lab, path, timeout=150)
        card = page.locator(".wb-exercise").first
        card.wait_for(timeout=30_000)
        box = card.locator("input.wb-ex-input")
        box.fill("P('model', None)")
        card.locator("button.wb-ex-check").click()
        page.locator(".wb-exercise[data-status='wrong']").wait_for(timeout=60_000)
        assert "4 times over" in card.locator(".wb-ex-explanation").inner_text()
        assert card.locator(".wb-ex-hint").inner_text().startswith("hint:")
        screenshot(card, "exercise-wrong")
        box.fill("P('data', None)")
        box.press("Enter")
        page.locator(".wb-exercise[data-status='correct']").wait_for(timeout=60_000)
        assert "exactly 1/8 each" in card.locator(".wb-ex-explanation").inner_text()
        assert card.locator(".wb-ex-verdict").inner_text().startswith("✓ correct")
        screenshot(card, "exercise-correct")
    except Exception:
        screenshot(page, "exercise-failure")
        raise
    finally:
        page.close()
