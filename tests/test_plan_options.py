"""``PlanOptions``: the one options object ``wb.plan`` and ``wb.search`` share. Reference: the
same plan or search made with the old keyword arguments, which still work."""
from __future__ import annotations

import optax
import pytest

import workbench as wb

TINY = wb.models.GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def mesh():
    return wb.abstract_mesh("v5p-8", data=4)


def test_options_and_keywords_plan_the_same_step(mesh):
    opts = wb.PlanOptions(optimizer=optax.sgd(1e-2), name="sgd", compile=False,
                          progress=False, memory_limit=2**30)
    a = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, seq=64, options=opts)
    b = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, seq=64, optimizer=optax.sgd(1e-2),
                name="sgd", compile=False, progress=False, memory_limit=2**30)
    assert a.to_dict() == b.to_dict() and a.name == "sgd"
    assert a.memory["limit"] == 2**30 and a.memory["optimizer"] == 0   # sgd keeps no state
    # a keyword fills in the options; the same value both ways is fine
    c = wb.plan(TINY, mesh=mesh, rules="fsdp", batch=8, seq=64, options=opts, name="sgd",
                dtype="float32")
    assert c.name == "sgd" and c.dtype.startswith("float32")
    assert opts.replace(name="other").name == "other" and opts.name == "sgd"


def test_bad_options_say_what_is_wrong(mesh):
    with pytest.raises(TypeError, match=r"wb.plan: unknown option\(s\) \['optimiser'\]; "
                                        r"PlanOptions has optimizer, dtype"):
        wb.plan(TINY, mesh=mesh, batch=8, optimiser=optax.sgd(1e-2))
    with pytest.raises(TypeError, match="not a PlanOptions"):
        wb.plan(TINY, mesh=mesh, batch=8, options={"progress": False})
    with pytest.raises(ValueError, match="name= is given twice"):
        wb.plan(TINY, mesh=mesh, batch=8, options=wb.PlanOptions(name="a"), name="b")
    with pytest.raises(TypeError, match="PlanOptions.replace: unknown option"):
        wb.PlanOptions().replace(batch=8)


def test_search_takes_the_same_options(mesh):
    opts = wb.PlanOptions(optimizer=optax.sgd(1e-2), progress=False)
    kw = dict(batch=8, seq=64, strategies=("dp", "fsdp"), remat=("none",), top_k=0)
    a = wb.search(TINY, "v5p-8", options=opts, **kw)
    b = wb.search(TINY, "v5p-8", optimizer=optax.sgd(1e-2), progress=False, **kw)
    assert [r["layout"] for r in a.rows] == [r["layout"] for r in b.rows]
    assert [r["step_seconds"] for r in a.rows] == [r["step_seconds"] for r in b.rows]
    assert all(p.memory["optimizer"] == 0 for p in a.plans.values())
    with pytest.raises(ValueError, match="options.compile=False is the search's to set"):
        wb.search(TINY, "v5p-8", options=opts.replace(compile=False), **kw)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['strategy'\]"):
        wb.search(TINY, "v5p-8", batch=8, strategy="dp", progress=False)
