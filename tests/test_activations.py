"""plan.activations against JAX's own sharding constraints; collectives traced to their
source lines, tensors and rules; compiler-inserted reshards as lints naming both ops."""
import inspect
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import workbench as wb
from workbench.planning._activations import _eqns
from workbench._step import lm_loss

pytestmark = pytest.mark.usefixtures("wb_cache")


@pytest.fixture(scope="module")
def plan():
    """Plain AdamW: with the Trainer's clipped AdamW (wb.plan's default since the one step
    resolver) one gradient all-reduce of a weight's dot comes without source metadata (the
    global norm reads it before the update): an open question, noted in the stop note."""
    return wb.plan(wb.models.GPTConfig.preset("tiny"), mesh=wb.make_mesh(data=4, model=2),
                   rules="fsdp_tp", batch=8, seq=32, progress=False,
                   optimizer=optax.adamw(3e-4))   # unclipped (see the docstring below)


def test_activations_are_the_constraints_jax_traces(plan):
    mesh = plan.batch_shardings["inputs"].mesh

    def loss(p, b):
        with plan.rules.activate(mesh):
            return lm_loss(nnx.merge(plan.graphdef, p), b)

    jaxpr = jax.make_jaxpr(loss)(plan.abstract_state.params, plan.abstract_batch)
    constraints = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "sharding_constraint"]
    mine = [a for a in plan.activations if a.source == "constrain"]
    # the embedding table and the embedded tokens, 7 per block, the logits
    assert len(mine) == len(constraints) == 2 + 2 * 7 + 1
    by_order = sorted(mine, key=lambda a: (a.layer is not None, a.layer or 0))
    names = [a.name for a in mine]
    assert names.count("mlp_hidden") == 2 and "logits" in names and "embedded" in names
    for eqn in constraints:
        shape = tuple(eqn.outvars[0].aval.shape)
        sharding = eqn.params["sharding"]
        ours = [a for a in by_order if a.shape == shape and
                tuple(() if s is None else s for s in a.spec) ==
                tuple(() if s is None else ((s,) if isinstance(s, str) else tuple(s))
                      for s in list(sharding.spec) + [None] * (len(shape) - len(sharding.spec)))]
        assert ours, (shape, sharding.spec)
        # bytes per device: JAX's shard shape of that sharding
        shard = NamedSharding(mesh, sharding.spec).shard_shape(shape)
        assert ours[0].bytes_per_device == math.prod(shard) * 4
    hidden = next(a for a in plan.activations if a.name == "mlp_hidden" and a.layer == 1)
    assert hidden.shape == (8, 32, 256) and hidden.spec == (("data",), (), ("model",))
    scores = [a for a in plan.activations if a.name == "attn_scores"]
    assert len(scores) == 2 and all(a.source == "jaxpr" for a in scores)
    # scores hold batch x heads x T x T float32 values, split over data (batch) and model
    # (heads), as the queries are
    assert all(a.bytes == 8 * 4 * 32 * 32 * 4 for a in scores)
    assert all(a.bytes_per_device == a.bytes // 8 for a in scores)


def test_scanned_layers_activations_count_every_layer():
    cfg = wb.models.GPTConfig.preset("tiny").replace(scan_layers=True)
    p = wb.plan(cfg, mesh=wb.make_mesh(data=8), rules="fsdp", batch=8, seq=32,
                compile=False, progress=False)
    hidden = [a for a in p.activations if a.name == "mlp_hidden"]
    assert len(hidden) == 1 and hidden[0].count == cfg.n_layers and hidden[0].layer is None


def _source_line(src: str) -> str:
    file, line = re.match(r"([^:]+):(\d+)", src).groups()
    root = Path(wb.__file__).parent
    path = next(root.rglob(file))
    return path.read_text().splitlines()[int(line) - 1]


def test_collectives_name_source_lines_tensors_and_rules(plan):
    text = plan.compiled.as_text()
    assert "stack_frame_id" in text        # the HLO op metadata we read
    checked = 0
    for c in plan.collectives:
        if c.kind == "all-gather" or any("->" in op for op in c.ops):
            assert c.sources, c     # the ops of the model's own lines have them
        for src, op in zip(c.sources, c.ops, strict=False):
            # a source line is the model's, never Workbench's plumbing (_compiled.graph._LIBRARY)
            assert not src.startswith(("_step.py", "rules.py", "_planner.py",
                                       "_activations.py")), src
            spec = re.search(r"\(([a-z,]+->[a-z]+)\)", op)
            if spec and src.startswith(("_gpt.py", "_layers.py")):   # the model's own lines
                # the line the compiler's metadata names holds that einsum
                assert spec.group(1) in _source_line(src), (src, op)
                checked += 1
    assert checked >= 4
    up = next(c for c in plan.collectives if "params.blocks.0.mlp.up" in c.tensors)
    assert up.kind == "all-gather" and up.axes == ("data",)
    assert up.rule.startswith("embed -> data (FSDP")
    # every all-gather instruction of a parameter in the HLO is one we attribute to it
    gathers = re.findall(r"all-gather(?:-start)?\(%(param[\w.]*)\)", text)
    assert sum(c.count for c in plan.collectives if c.kind == "all-gather"
               and any(t.startswith("params.") for t in c.tensors)) >= len(gathers)
    tp = [c for c in plan.collectives if c.kind == "all-reduce" and c.axes == ("model",)]
    assert tp and all("tensor parallel" in c.rule for c in tp)
    dp = [c for c in plan.collectives if c.kind == "all-reduce" and c.axes == ("data",)]
    assert dp and all(c.rule.startswith("batch -> data") for c in dp)


class Conflict(nnx.Module):
    """Two constraints that want the hidden activation laid out differently."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (64, 64)), out_sharding=(None, "model"))
        self.w2 = nnx.Param(init(rngs.params(), (64, 64)), out_sharding=(None, None))

    def __call__(self, x):
        h = jax.nn.relu(x @ self.w1[...])
        h = jax.lax.with_sharding_constraint(h, P("data", "model"))
        h = jax.lax.with_sharding_constraint(h, P("model", "data"))
        return jnp.tanh(h) @ self.w2[...]


def test_compiler_inserted_reshard_is_a_lint_naming_both_ops():
    ex = {k: jax.ShapeDtypeStruct((16, 64), jnp.float32) for k in "xy"}
    p = wb.plan(Conflict, mesh=wb.make_mesh(data=2, model=4), batch=16, example_batch=ex,
                loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), progress=False)
    lints = [w for w in p.warnings if w.kind == "reshard"]
    assert lints, [str(w) for w in p.warnings]
    src, first = inspect.getsourcelines(Conflict.__call__)
    lines = {f"test_activations.py:{first + i}" for i, _ in enumerate(src)}
    # JAX's own answer: the reshard instructions are in the compiled HLO
    text = p.compiled.as_text()
    for r in p.reshards:
        assert re.search(rf"%{re.escape(r.name)} = ", text)
    named = [w for w in lints if any(ln in w.message for ln in lines)]
    assert named, [w.message for w in lints]
    msg = named[0].message
    assert sum(ln in msg for ln in lines) >= 1 and "between" in msg


@pytest.mark.tpu
def test_tpu_compiled_plan_collectives_have_sources():
    p = wb.plan(wb.models.GPTConfig.preset("tiny"), mesh=wb.abstract_mesh("v5p-8", data=4),
                rules="fsdp", batch=8, seq=32, progress=False)
    assert p.source == "tpu-compiler"
    gathers = [c for c in p.collectives if c.kind == "all-gather"]
    assert gathers and all(c.sources for c in gathers)
    assert any(t.startswith("params.") for c in gathers for t in c.tensors)
    assert all(c.rule and "embed -> data" in c.rule for c in gathers
               if any(t.startswith("params.") for t in c.tensors))
    assert np.isfinite(sum(a.bytes_per_device for a in p.activations))


# -- the plan widget's activations and collectives tabs ------------------------------------

def _render_js(tmp_path, state, actions):
    import json
    import shutil
    import subprocess

    from workbench.widgets import _assets

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (needed to run the widget ESM)")
    here = Path(__file__).parent / "widgets_js"
    (tmp_path / "plan.mjs").write_text(_assets.esm("plan"))
    (tmp_path / "state.json").write_text(json.dumps(state))
    (tmp_path / "actions.json").write_text(json.dumps(actions))
    out = subprocess.run([node, str(here / "render.mjs"), str(tmp_path / "plan.mjs"),
                          str(tmp_path / "state.json"), str(tmp_path / "actions.json")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_widget_activations_tab_lists_the_plans_activations(plan, tmp_path):
    from workbench.widgets._plan_view import plan_payload

    p = plan_payload(plan)
    state = {"payload": p, "tab": "overview", "selected_collective": -1, "collective_note": ""}
    rep = _render_js(tmp_path, state, [{"op": "click", "cls": "wb-tab", "index": 1}])
    assert rep["state"]["tab"] == "activations"
    assert len(rep["rows"]) == len(plan.activations)
    hidden = next(a for a in plan.activations if a.name == "mlp_hidden" and a.layer == 0)
    row = next(r for r in rep["rows"] if r[0] == "mlp_hidden" and r[1] == "0")
    assert row[2] == f"float32[{', '.join(map(str, hidden.shape))}]"
    assert row[4] == "P(data, None, model)"


def test_widget_collectives_tab_click_draws_before_and_after(plan, tmp_path):
    from workbench.widgets._plan_view import PlanView, plan_payload

    p = plan_payload(plan)
    state = {"payload": p, "tab": "collectives", "selected_collective": -1,
             "collective_note": ""}
    rep = _render_js(tmp_path, state, [{"op": "click", "cls": "wb-row", "index": 0}])
    # rows sorted by bytes sent: the first row is the collective that sends the most
    top = max(range(len(plan.collectives)),
              key=lambda i: plan.collectives[i].total_wire_bytes)
    assert rep["state"]["selected_collective"] == top
    assert len(rep["rows"]) == len(plan.collectives)
    assert plan.collectives[top].sources[0] in rep["rows"][0]
    # Python draws the layouts of what the click picked: a parameter's FSDP gather
    view = PlanView(plan)
    i = next(i for i, c in enumerate(plan.collectives) if "params.blocks.0.mlp.up" in c.tensors)
    view.select_collective(i)
    drawn = next(t for t in plan.collectives[i].tensors if t in plan.layouts)
    lay = plan.layouts[drawn]           # the first parameter the merged gathers move
    assert view.exchange.layout.display == "flex"
    from workbench.widgets._payload import layout_payload

    assert view.before.payload == layout_payload(lay)
    gathered = wb.layout(lay.shape, (None, "model"), plan.mesh, name="x")
    assert view.after.payload["blocks"] == layout_payload(gathered)["blocks"]
    assert "gathered over data" in view.summary.collective_note
