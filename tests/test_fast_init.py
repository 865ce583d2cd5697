"""The sharded init in one random expansion (workbench/_param_init.py): the same weights as
the model built eagerly, drawn into their shards, the same in every process; runs saved
before it resume from their checkpoints.

References: the eager model (``GPT(cfg, rngs=nnx.Rngs(params=key))``: JAX's own
``jax.random.normal`` per parameter), the abstract state's shardings, NumPy's row-major
indices, Orbax's own reader of a checkpoint, and ``tests/old_init_run``: a run directory the
code before this change wrote (seed 3; 2 steps saved) with the losses its uninterrupted run
logged (``expected.json``: steps 1-4, the JAX version and XLA flags they were computed with).
It was made by training that config to step 2, copying the run directory, and training the
original on to step 4.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType

import workbench as wb
from workbench import _param_init as param_init
from workbench import _step, _train_state
from workbench._sharding.pytrees import path_str
from workbench._sharding.rules import Rules
from workbench.models import GPT, GPTConfig

CFG = GPTConfig.preset("tiny", seq_len=32)
OLD_RUN = Path(__file__).parent / "old_init_run"


def _mesh(shape):
    names = ("data", "model")[:len(shape)]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _eager(cfg, seed):
    return nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(params=jax.random.key(seed))),
                                      nnx.Param))


def _init(cfg, preset, mesh, seed=0):
    """``(params, abstract params, jaxpr)`` of the Trainer's init for ``preset``."""
    graphdef, abstract = _train_state.abstract_state(cfg, optax.adamw(1e-3),
                                                     Rules.preset(preset, mesh), mesh)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    f = _step.sharded_init(cfg, optax.adamw(1e-3), shardings)
    key = jax.random.key(seed)
    return f(key).params, abstract.params, jax.make_jaxpr(f)(key)


def _threefry_sizes(jaxpr):
    """Output elements of every threefry2x32 call in ``jaxpr`` and its sub-jaxprs (the
    shard_map body's shapes are per device)."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "threefry2x32":
            sizes.append(int(np.prod(eqn.outvars[0].aval.shape)))
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)   # a ClosedJaxpr's, or a Jaxpr
            if hasattr(sub, "eqns"):
                sizes += _threefry_sizes(sub)
    return sizes


def _normal_elements_per_device(abstract):
    """Elements of one device's shards of the normal-initialised parameters (norm scales
    are ones: not drawn)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape)))
               for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]
               if not path_str(p).endswith("scale"))


@pytest.mark.parametrize("preset,shape,overrides", [
    ("dp", (8,), {}),
    ("fsdp", (4, 2), {}),                 # embed over ("data", "model"): two axes on one dim
    ("fsdp_tp", (4, 2), {}),
    ("tp", (4, 2), {"scan_layers": True}),   # stacked layers: one key per layer
    ("fsdp", {"stage": 2, "data": 4}, {"scan_layers": True, "n_layers": 4}),  # keys per stage
])
def test_one_expansion_draws_the_eager_weights_into_their_shards(preset, shape, overrides):
    cfg = CFG.replace(**overrides)
    mesh = wb.make_mesh(**shape) if isinstance(shape, dict) else _mesh(shape)
    params, abstract, jaxpr = _init(cfg, preset, mesh)
    want = _eager(cfg, 0)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(flat) == len(jax.tree.leaves(want))
    for (path, got), ref, a in zip(flat, jax.tree.leaves(want), jax.tree.leaves(abstract),
                                   strict=True):
        assert got.sharding.is_equivalent_to(a.sharding, got.ndim), path_str(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=path_str(path))
    # one expansion of exactly this device's shards; the rest derive keys (a few each)
    big = [n for n in _threefry_sizes(jaxpr.jaxpr) if n > 2 * cfg.n_layers + 4]
    assert big == [_normal_elements_per_device(abstract)]


def test_moe_experts_and_router_are_drawn_too():
    cfg = GPTConfig.preset("moe-tiny", n_layers=1, seq_len=32)
    params, abstract, jaxpr = _init(cfg, "fsdp_tp", _mesh((4, 2)))
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(_eager(cfg, 0)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert len([n for n in _threefry_sizes(jaxpr.jaxpr) if n > 8]) == 1


def test_chunks_split_the_expansion_with_the_same_values(monkeypatch):
    cfg = CFG.replace(n_layers=1)
    monkeypatch.setattr(param_init, "CHUNK", 4096)   # embed and lm_head alone, blocks packed
    params, abstract, jaxpr = _init(cfg, "dp", _mesh((8,)))
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(_eager(cfg, 0)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    big = [n for n in _threefry_sizes(jaxpr.jaxpr) if n > 8]
    assert len(big) > 2 and max(big) <= 256 * 64 and sum(big) == \
        _normal_elements_per_device(abstract)


def test_parameters_off_a_mesh_are_drawn_as_before():
    """A sharding the expansion cannot use (one device, no mesh): jax.random.normal under
    the jit, as before; the values are the same."""
    cfg = CFG.replace(n_layers=1)
    _, abstract, _ = _train_state.abstract_model(cfg)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, abstract)
    got = _step.sharded_init(cfg, None, shardings)(jax.random.key(5))
    for g, ref in zip(jax.tree.leaves(got), jax.tree.leaves(_eager(cfg, 5)), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(ref))


@pytest.mark.parametrize("shape,limit_block", [((6, 5, 4), ((2, 5, 2), (4, 0, 2))),
                                               ((7,), ((3,), (3,))), ((), ((), ()))])
def test_counters_are_numpys_row_major_indices(shape, limit_block):
    local, starts = limit_block
    got = param_init.threefry_counts(shape, local, starts)
    index = np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape)
    want = index[tuple(slice(s, s + n) for s, n in zip(starts, local))]
    np.testing.assert_array_equal(np.asarray(got), want)


CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from test_fast_init import CFG, _digest, _init, _mesh
for seed in (0, 1):
    print(seed, _digest(_init(CFG, "fsdp_tp", _mesh((4, 2)), seed=seed)[0]))
"""


def _digest(params):
    return hashlib.sha256(b"".join(np.asarray(x).tobytes()
                                   for x in jax.tree.leaves(params))).hexdigest()


@pytest.mark.multiprocess
def test_a_seed_gives_the_same_weights_in_another_process():
    out = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    child = dict(line.split() for line in out.stdout.splitlines() if line[:2] in ("0 ", "1 "))
    here = _digest(_init(CFG, "fsdp_tp", _mesh((4, 2)), seed=0)[0])
    assert child["0"] == here
    assert child["1"] != child["0"]


def _same_environment(expected):
    flags = set(os.environ.get("XLA_FLAGS", "").split())
    return expected["jax"] == jax.__version__ and set(expected["xla_flags"].split()) == flags


def _assert_losses(got, want, expected):
    """Bitwise where the fixture's losses were computed by this JAX under these XLA flags;
    else to float32 rounding grown by Adam's normalised updates (see test_scan_layers)."""
    if _same_environment(expected):
        assert got == want
    else:
        np.testing.assert_allclose(got, want, rtol=1e-3)


@pytest.mark.slow
def test_a_run_saved_before_resumes_from_its_checkpoint(tmp_path):
    expected = json.loads((OLD_RUN / "expected.json").read_text())
    config = wb.TrainConfig.from_dict(expected["config"])
    run_dir = tmp_path / "run"
    shutil.copytree(OLD_RUN / "run", run_dir)
    tr = wb.Trainer(config, run_dir=run_dir, progress=None)
    assert tr.step == 2
    saved = ocp.PyTreeCheckpointer().restore(run_dir / "checkpoints" / "2" / "state")
    restored = {path_str(p): x for p, x in
                jax.tree_util.tree_flatten_with_path(tr.state.params)[0]}
    on_disk = {path_str(p): x for p, x in
               jax.tree_util.tree_flatten_with_path(saved["train"]["params"])[0]}
    assert restored.keys() == on_disk.keys()
    for name, x in restored.items():
        np.testing.assert_array_equal(np.asarray(x), on_disk[name], err_msg=name)
    seeded = _eager(config.model_config(), config.seed)
    assert not np.array_equal(np.asarray(tr.state.params["embed"]), seeded["embed"])
    tr.run(steps=4)
    tr.close()
    assert tr.losses[:2] == expected["losses"][:2]   # the history it had
    _assert_losses(tr.losses[2:], expected["losses"][2:], expected)


@pytest.mark.slow
def test_the_seed_still_starts_where_the_saved_run_started(tmp_path):
    """A fresh run of the fixture's config: its first losses are those the old init gave
    (the initial weights of a seed did not change)."""
    expected = json.loads((OLD_RUN / "expected.json").read_text())
    config = wb.TrainConfig.from_dict(expected["config"])
    tr = wb.Trainer(config, run_dir=tmp_path / "fresh", progress=None)
    tr.run(steps=2)
    tr.close()
    _assert_losses(tr.losses, expected["losses"][:2], expected)
