"""penzai models through wb.any_model.from_penzai: the same parameter bytes per device as our
GPT of the same shapes, errors for uncovered axes, training and bitwise resume, treescope."""
import math

import jax
import numpy as np
import pytest

import workbench as wb
from tests._tolerance import assert_close_at_scale
from workbench.any_model._spec import UnknownAxesError

pytestmark = pytest.mark.usefixtures("wb_cache")

lc = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")


def tiny_like(cfg):
    """penzai's Llama-like config with the shapes of our GPT config ``cfg``."""
    return lc.LlamalikeTransformerConfig(
        num_kv_heads=cfg.n_kv_heads, query_head_multiplier=cfg.n_heads // cfg.n_kv_heads,
        embedding_dim=cfg.d_model, projection_dim=cfg.head_dim, mlp_hidden_dim=cfg.d_ff,
        num_decoder_blocks=cfg.n_layers, vocab_size=cfg.vocab_size, mlp_variant="swiglu",
        tie_embedder_and_logits=cfg.tie_embeddings)


@pytest.fixture(scope="module")
def tiny():
    return wb.models.GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def spec(tiny):
    config = tiny_like(tiny)
    return wb.any_model.from_penzai(
        lambda key: lc.build_llamalike_transformer(config, init_base_rng=key), config=config,
        name="penzai-tiny")


@pytest.mark.parametrize("rules", ["fsdp", "fsdp_tp", "tp"])
def test_same_parameter_bytes_per_device_as_our_gpt(tiny, spec, rules):
    mesh = wb.make_mesh(data=4, model=2)
    ours = wb.plan(tiny, mesh=mesh, rules=rules, batch=8, seq=32, compile=False,
                   progress=False)
    theirs = wb.plan(spec, mesh=mesh, rules=rules, batch=8, seq=32, compile=False,
                     progress=False)
    assert theirs.memory["params"] == ours.memory["params"]
    assert theirs.memory["optimizer"] == ours.memory["optimizer"]
    # hand count: every parameter's bytes divided by the devices its spec shards it over
    sizes = dict(mesh.shape)
    hand = sum(4 * math.prod(lay.shape) // math.prod(sizes[a] for axes in lay.spec for a in axes)
               for k, lay in theirs.layouts.items() if k.startswith("params."))
    assert theirs.memory["params"] == hand
    n_ours = sum(math.prod(x.shape) for x in jax.tree.leaves(ours.abstract_state.params))
    n_theirs = sum(math.prod(x.shape) for x in jax.tree.leaves(theirs.abstract_state.params))
    assert n_ours == n_theirs
    # penzai's names are the logical axes, sharded as the GPT's
    q = theirs.layouts["params.params.block_0.attention.query.weights"]
    assert q.logical_axes == ("embedding", "head_groups", "query_heads", "projection")


def test_uncovered_penzai_axes_are_listed(spec):
    mesh = wb.make_mesh(data=8)
    with pytest.raises(UnknownAxesError) as err:
        wb.plan(spec, mesh=mesh, rules=wb.Rules(batch="data", embed="data"), batch=8,
                seq=16, compile=False)
    msg = str(err.value)
    for name in ("neurons", "vocabulary", "head_groups", "projection"):
        assert repr(name) in msg
    assert "'embedding'" not in msg   # covered through embed


def test_forward_matches_penzai(spec, tiny):
    """The adapted module's logits are penzai's own on the same parameters."""
    from penzai import pz

    config = tiny_like(tiny)
    model = lc.build_llamalike_transformer(config, init_base_rng=jax.random.key(3))
    adapted = wb.any_model.from_penzai(model, config=config)(__import__("flax").nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    want = jax.jit(lambda t: model(pz.nx.wrap(t).tag("batch", "seq")).unwrap(
        "batch", "seq", "vocabulary"))(tokens)
    got = jax.jit(lambda t: adapted(t))(tokens)
    # the adapter runs penzai's own layers in penzai's order: equal here bitwise; 1e-6 at the
    # logits' scale (~8 float32 eps) allows the two jits to fuse differently, no more
    assert_close_at_scale(got, want, rtol=1e-6)


@pytest.mark.slow
def test_penzai_trains_and_resumes_bitwise(spec, tmp_path):
    cfg = wb.TrainConfig(model=spec, mesh={"data": 4, "model": 2}, rules="fsdp_tp", batch=8,
                         seq=32, steps=4, checkpoint_every=2, data="synthetic",
                         optimizer=wb.train.AdamW(lr=3e-3, warmup_steps=0))
    straight = wb.Trainer(cfg, tmp_path / "a", progress=None)
    straight.run()
    assert straight.losses[-1] < straight.losses[0]
    spec_q = straight.state.params["params"]["block_0"]["attention"]["query"]["weights"]
    assert spec_q.sharding.spec[:2] == ("data", "model")
    first = wb.Trainer(cfg, tmp_path / "b", progress=None)
    first.run(steps=2)
    again = wb.Trainer(cfg, tmp_path / "b", progress=None)
    assert again.step == 2
    again.run()
    assert again.losses == straight.losses
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 again.state.params, straight.state.params)


@pytest.mark.slow
def test_show_renders_the_penzai_model_in_treescope(spec):
    plan = wb.plan(spec, mesh=wb.make_mesh(data=4, model=2), rules="fsdp_tp", batch=8,
                   seq=16, compile=False, progress=False)
    view = wb.show(plan)
    view.tensors.table.want_treescope = True
    assert view.tensors.table.treescope_html.startswith("<")
    from penzai import pz
    from penzai.models.transformer.model_parts import TransformerLM

    drawn = view.tensors.tree                     # what the treescope tab rendered
    assert isinstance(drawn, TransformerLM)
    values = jax.tree_util.tree_leaves(drawn, is_leaf=lambda x: isinstance(x, pz.ParameterValue))
    params = {p.label: p.value for p in values if isinstance(p, pz.ParameterValue)}
    q = params["transformer/block_0/attention/query.weights"]
    want = plan.shardings.params["params"]["block_0"]["attention"]["query"]["weights"]
    assert q.data_array.sharding.spec == want.spec == jax.sharding.PartitionSpec(
        "data", "model", None, None)
