"""wb.plan compiles the program the Trainer trains: for every rules preset and for rules
that shard the sequence, the plan's compiled step and ``Trainer.compiled_step()`` have the
same input/output shardings and the same collectives in XLA's optimized HLO."""
import collections
import re

import jax
import pytest

import workbench as wb
from workbench._sharding.rules import Rules

MESH = {"data": 4, "model": 2}
COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\S+)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$")


def _rules(name):
    mesh = wb.make_mesh(**MESH)
    if name == "seq":                        # sequence parallel: tokens split along T
        return Rules.preset("dp", mesh).replace(batch="data", seq="model")
    if name == "seq_fsdp":                   # and weights sharded over the data axis (FSDP)
        return Rules.preset("dp", mesh).replace(batch="data", seq="model", embed="data")
    return Rules.preset(name, mesh)


def _collectives(hlo):
    """Multiset of (op, result shape, replica groups / pairs) read from the HLO text."""
    out = collections.Counter()
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            groups = re.search(r"(replica_groups=\S+|source_target_pairs=\S+)", m["rest"])
            out[(m["op"], re.sub(r"\{[0-9,]*\}(?=[,)\s]|$)", "", m["shape"]),
                 groups[1] if groups else "")] += 1
    return out


def _leaves(shardings):
    return jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


@pytest.mark.parametrize("rules_name", ["dp", "fsdp", "tp", "fsdp_tp", "seq", "seq_fsdp"])
@pytest.mark.slow
def test_plan_compiles_the_trainers_step(rules_name, tmp_path):
    rules = _rules(rules_name)
    config = wb.TrainConfig(model="tiny", model_overrides={"n_layers": 1}, mesh=MESH,
                            rules=rules, batch=8, seq=32, data="synthetic", steps=2)
    trainer = wb.Trainer(config, run_dir=tmp_path / "run", progress=None, compile_cache=False,
                         async_checkpoint=False)
    theirs = trainer.compiled_step()
    p = wb.plan(trainer.parts.model_config, mesh=trainer.mesh, rules=trainer.rules,
                batch=config.batch, seq=config.seq, optimizer=trainer.parts.tx, progress=False)
    ours = p.compiled

    for mine, want in ((ours.input_shardings, theirs.input_shardings),
                       (ours.output_shardings, theirs.output_shardings)):
        a, b = _leaves(mine), _leaves(want)
        assert len(a) == len(b)
        assert all(x == y for x, y in zip(a, b)), [(x, y) for x, y in zip(a, b) if x != y][:3]
    hlo_ours, hlo_theirs = _collectives(ours.as_text()), _collectives(theirs.as_text())
    assert hlo_ours == hlo_theirs
    assert p.batch_shardings == trainer.parts.batch_shardings
    if rules.get("seq") is not None:      # the sequence really is split: tokens are (B/d, T/s)
        (spec,) = {s.spec for s in trainer.parts.batch_shardings.values()}
        assert spec[1] is not None and p.layouts["batch.inputs"].partitions[1] > 1
