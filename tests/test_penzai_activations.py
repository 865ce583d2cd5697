"""plan.activations of a penzai model: per layer, the attention output (before its output
projection) and the MLP hidden activation, checked against the dot_generals of the plain
forward pass's jaxpr (their shapes and count) and sharded by the plan's rules."""
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import workbench as wb
from workbench.planning._activations import _eqns

pytestmark = pytest.mark.usefixtures("wb_cache")

lc = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")

LAYERS, B, T = 2, 8, 32


@pytest.fixture(scope="module")
def plan():
    config = lc.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=64, projection_dim=16,
        mlp_hidden_dim=128, num_decoder_blocks=LAYERS, vocab_size=256, mlp_variant="swiglu",
        tie_embedder_and_logits=False)
    spec = wb.any_model.from_penzai(
        lambda key: lc.build_llamalike_transformer(config, init_base_rng=key), config=config,
        name="pz")
    return wb.plan(spec, mesh=wb.make_mesh(data=4, model=2), rules="fsdp_tp", batch=B, seq=T,
                   compile=False, progress=False)


def _forward_dots(plan):
    """(lhs shape, contracted sizes) of every dot_general of the plain forward pass (no
    recording, no rules): the reference."""
    def forward(p, tokens):
        return nnx.merge(plan.graphdef, p)(tokens)
    closed = jax.make_jaxpr(forward)(plan.abstract_state.params,
                                     jax.ShapeDtypeStruct((B, T), jnp.int32))
    out = []
    for e in _eqns(closed.jaxpr):
        if e.primitive.name == "dot_general":
            (lc_dims, _), _ = e.params["dimension_numbers"]
            lhs = tuple(int(d) for d in e.invars[0].aval.shape)
            out.append((lhs, tuple(sorted(lhs[d] for d in lc_dims))))
    return out


@pytest.mark.parametrize("name,contracted", [
    ("attn_out", ("head_groups", "query_heads", "projection")), ("mlp_hidden", ("neurons",))])
def test_penzai_layer_activations_are_the_forward_dots_inputs(plan, name, contracted):
    acts = [a for a in plan.activations if a.name == name]
    assert [a.layer for a in acts] == list(range(LAYERS))
    dots = _forward_dots(plan)
    for a in acts:
        assert a.source == "jaxpr"
        sizes = tuple(sorted(a.shape[a.logical.index(n)] if n in a.logical else None
                             for n in contracted))
        # the output projection / MLP down projection: a dot whose input is this tensor
        # (its dims in any order) contracting exactly the named dims
        match = [d for d in dots if sorted(d[0]) == sorted(a.shape) and d[1] == sizes]
        assert len(match) == LAYERS
        # sharded as the rules say for its named dims, bytes per device by hand
        mesh = dict(plan.mesh.shape)
        for n, axes in zip(a.logical, a.spec):
            want = plan.rules.mesh_axes(n) if n is not None and n in plan.rules else None
            if axes is not None and n is not None:
                assert tuple(axes) == tuple(want or ())
        per = 4 * math.prod(d // math.prod(mesh[x] for x in (s or ()))
                            for d, s in zip(a.shape, a.spec))
        assert a.bytes_per_device == per


@pytest.mark.slow
def test_recording_does_not_change_the_model(plan):
    """The recorders are identity layers: the loss traced with and without them agrees."""
    model = plan.materialize(seed=0)
    tokens = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) % 256
    plain = model(tokens)
    from workbench.any_model._penzai import with_activation_records
    from penzai import pz
    recorded = with_activation_records(model.penzai())(pz.nx.wrap(tokens).tag("batch", "seq"))
    assert jnp.array_equal(plain, recorded.unwrap("batch", "seq", "vocabulary"))
