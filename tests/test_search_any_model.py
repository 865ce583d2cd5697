"""wb.search of any model wb.plan takes: the Flax guide's model (annotations naming mesh
axes: the candidates are meshes with those axes) and a penzai model (the penzai_rules
presets); the best candidate's plan equals wb.plan of that candidate built directly."""
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import workbench as wb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import DotReluDot  # noqa: E402  (constrain=False: no activation constraint here)

pytestmark = pytest.mark.usefixtures("wb_cache")

D = 64
LIMIT = 2 ** 30


def guide_spec():
    return wb.any_model.from_nnx(
        lambda rngs: DotReluDot(D, rngs, constrain=False), name="guide",
        example_batch=lambda b, t: {k: jax.ShapeDtypeStruct((b, D), jnp.float32) for k in "xy"},
        loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))


def check_best_is_its_plan(res, spec, *, batch, seq=None, rules=None):
    """The best row's plan against wb.plan of the same mesh and rules, compiled."""
    best = res.best_row
    mesh = wb.make_mesh(best["mesh"])
    ref = wb.plan(spec, mesh=mesh, rules=rules, batch=batch, seq=seq, memory_limit=LIMIT,
                  progress=False)
    assert res.best.source == ref.source == "cpu-compiler"
    assert res.best.memory == ref.memory
    assert res.best.rules == ref.rules
    assert best["step_seconds"] == ref.predicted.step_seconds
    assert best["memory_per_device"] == ref.memory["total"]


def test_guide_model_searches_meshes_with_its_axes():
    spec = guide_spec()
    res = wb.search(spec, batch=16, top_k=1, memory_limit=LIMIT, progress=False)
    # candidates: data x model over the 8 devices, every power-of-two model axis
    assert sorted(r["mesh"]["model"] for r in res.rows) == [1, 2, 4, 8]
    assert all(set(r["mesh"]) == {"data", "model"} and math.prod(r["mesh"].values()) == 8
               and r["rules"] == "annotations" and r["remat"] is None for r in res.rows)
    # no rules given: wb.plan resolves the same rules from the annotations
    check_best_is_its_plan(res, spec, batch=16, rules=None)
    # every fitting row is the analytic plan of its layout
    for r in res.rows:
        ref = wb.plan(spec, mesh=wb.make_mesh(r["mesh"]), batch=16, compile=False,
                      memory_limit=LIMIT, progress=False)
        assert r["analytic_memory_per_device"] == ref.memory["total"]
    assert "guide of" in res.summary()
    from workbench.widgets._search_view import search_payload

    payload = search_payload(res)   # the widget's rows, JSON as the browser gets them
    assert json.loads(json.dumps(payload, allow_nan=False)) == payload
    assert [r["layout"] for r in payload["rows"]] == [r["layout"] for r in res.rows]


def test_search_without_a_memory_limit_draws(tmp_path):
    """On CPU devices the memory per device is unknown: every row says so, and the
    figure's hover text says 'limit unknown'."""
    from workbench.widgets._search_view import search_figure

    res = wb.search(guide_spec(), batch=16, exact=False, progress=False)
    assert all(r["fits"] is None for r in res.rows)
    hover = " ".join(t for tr in search_figure(res).data for t in (tr.hovertext or ()))
    assert hover.count("limit unknown") >= len(res.rows)


def test_a_plain_factory_takes_loss_fn_and_example_batch():
    spec = guide_spec()
    res = wb.search(lambda rngs: DotReluDot(D, rngs, constrain=False), batch=16, exact=False,
                    loss_fn=spec.loss_fn, example_batch=spec.example_batch, progress=False)
    ref = wb.search(spec, batch=16, exact=False, progress=False)
    assert [(r["layout"], r["memory_per_device"]) for r in res.rows] == \
        [(r["layout"], r["memory_per_device"]) for r in ref.rows]


@pytest.mark.slow
def test_penzai_model_searches_the_presets():
    lc = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
    config = lc.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=64, projection_dim=16,
        mlp_hidden_dim=128, num_decoder_blocks=2, vocab_size=256, mlp_variant="swiglu",
        tie_embedder_and_logits=False)
    spec = wb.any_model.from_penzai(
        lambda key: lc.build_llamalike_transformer(config, init_base_rng=key), config=config,
        name="pz")
    res = wb.search(spec, batch=8, seq=32, top_k=1, memory_limit=LIMIT, progress=False)
    assert {r["rules"] for r in res.rows} == {"dp", "fsdp", "tp", "fsdp_tp"}
    # 2 kv heads do not divide over model=4 or 8: skipped with the parameter named
    bad = [s for s in res.skipped if s["mesh"]["model"] > 2]
    assert bad and all("head_groups" in s["reason"] for s in bad)
    for s in bad:  # the reference: JAX refuses the layout
        with pytest.raises(ValueError):
            wb.plan(spec, mesh=wb.make_mesh(s["mesh"]), rules=s["rules"], batch=8, seq=32,
                    progress=False)
    check_best_is_its_plan(res, spec, batch=8, seq=32, rules=res.best_row["rules"])


def test_factory_search_refuses_remat_and_a_non_callable():
    with pytest.raises(ValueError, match="sets its own remat"):
        wb.search(guide_spec(), batch=16, remat=("full",), progress=False)
    with pytest.raises(TypeError, match="GPTConfig or a model factory"):
        wb.search(42, batch=16, progress=False)
