"""The plan's report apart from its runnable handle: the report is plain data (a JSON round
trip gives back the same summary, dict and prediction), the handle runs the step, and the
plan shows the report's user-facing numbers as explicit properties, never forwarding the
rest (``plan.report.<name>``)."""
from __future__ import annotations

import json

import pytest

import workbench as wb
from workbench.planning import Plan, PlanReport
from workbench.planning._handle import _REPORT_NAMES

TINY = wb.models.GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def compiled_plan():
    mesh = wb.make_mesh(data=4, model=2)
    return wb.plan(TINY, mesh=mesh, rules="fsdp_tp", batch=8, seq=32, progress=False)


@pytest.fixture(scope="module")
def abstract_plan():
    return wb.plan(TINY.replace(scan_layers=True), mesh=wb.abstract_mesh("v5p-32", data=8, model=2),
                   rules="fsdp_tp", batch=16, seq=64, compile=False, progress=False)


def _round_trip(report: PlanReport) -> PlanReport:
    return PlanReport.from_json(json.loads(json.dumps(report.to_json())))


def test_an_estimated_report_survives_json(abstract_plan):
    back = _round_trip(abstract_plan.report)
    assert back.to_dict() == abstract_plan.report.to_dict()
    assert str(back) == str(abstract_plan)          # summary, memory rows, collectives, lints
    assert back.predicted == abstract_plan.predicted
    assert back.cfg == abstract_plan.cfg and back.rules == abstract_plan.rules
    assert back.layouts.keys() == abstract_plan.layouts.keys()
    for k, lay in abstract_plan.layouts.items():
        assert (back.layouts[k].spec, back.layouts[k].shard_shape, back.layouts[k].dtype) == \
            (lay.spec, lay.shard_shape, lay.dtype), k


def test_a_compiled_report_survives_json_with_the_compilers_numbers(compiled_plan):
    assert compiled_plan.compiled is not None and compiled_plan.report.compiled_numbers
    back = _round_trip(compiled_plan.report)
    report = compiled_plan.report
    assert back.compiled_numbers is not None and back.cost == report.cost
    assert back.compiled_flops_per_device == report.compiled_flops_per_device
    assert back.to_dict() == report.to_dict()     # memory, collectives, prediction
    assert back.mesh.jax_mesh is None                   # nothing to run on: abstract now


def test_a_report_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="not a plan report"):
        PlanReport.from_json({"format": "something-else"})


def test_the_handle_runs_and_the_report_does_not(compiled_plan):
    report = compiled_plan.report
    for name in ("materialize", "train_step", "init_state", "compiled", "jitted",
                 "graphdef", "shardings", "factory"):
        assert hasattr(compiled_plan, name) and not hasattr(report, name), name
    # the plan shows the report's user-facing numbers, each an explicit property
    assert compiled_plan.memory is report.memory and compiled_plan.warnings is report.warnings
    assert compiled_plan.predicted is report.predicted
    assert compiled_plan.summary() == report.summary() and repr(compiled_plan) == repr(report)
    assert compiled_plan.memory_rows() == report.memory_rows()
    for name in ("source", "fits", "layouts", "flops_per_device", "kernel_flops",
                 "compiler_options", "dtype", "model_flops"):
        assert isinstance(getattr(Plan, name), property), name
        assert getattr(compiled_plan, name) == getattr(report, name), name
    assert "memory" in dir(compiled_plan) and "loops" not in dir(compiled_plan)
    # ... and forwards nothing else: the rest says where it is
    assert {"memory", "collectives", "to_json", "loops", "batch", "cost"} <= _REPORT_NAMES
    assert "__getattr__" not in vars(PlanReport)
    for name in ("loops", "compiler_cycles", "compiled_numbers", "to_json", "batch", "seq",
                 "memory_estimate", "cost", "compute_split", "to_dict", "is_estimate"):
        with pytest.raises(AttributeError, match=rf"no attribute '{name}': it is the "
                                                 rf"report's, plan.report.{name}"):
            getattr(compiled_plan, name)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'$"):
        compiled_plan.nonsense
    import jax
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(compiled_plan.materialize(seed=0), nnx.Param))
    assert sum(x.size for x in leaves) == TINY.n_params
    assert {x.sharding.mesh for x in leaves} == {compiled_plan.report.mesh.jax_mesh}
    assert isinstance(compiled_plan, Plan) and isinstance(report, PlanReport)


def test_plan_is_its_stages_in_order(abstract_plan):
    """``wb.plan`` is resolve -> choose_target -> build_step -> measure -> lint: run by hand,
    the stages give the same report."""
    from workbench.planning._measure import measure
    from workbench.planning._stages import build_step, choose_target, lint, resolve
    from workbench._step import lm_loss

    inp = resolve(abstract_plan.cfg, mesh=abstract_plan.mesh, rules="fsdp_tp", batch=16,
                  seq=64, optimizer=None, dtype=None, name=None, compile=False,
                  memory_limit=None, loss_fn=lm_loss, example_batch=None, pipeline=None,
                  overlap=True)
    setup = choose_target(inp)
    assert setup.target.source == "estimate" and setup.mesh is None
    step = build_step(inp, setup)
    m = measure(inp, setup, step, progress=False)
    warnings = lint(inp, setup, step, m, 16 * 1024 ** 2)
    assert m.memory == abstract_plan.memory and step.flops == abstract_plan.report.flops
    assert [c.to_dict() for c in m.collectives] == \
        [c.to_dict() for c in abstract_plan.collectives]
    assert [w.to_dict() for w in warnings] == [w.to_dict() for w in abstract_plan.warnings]
