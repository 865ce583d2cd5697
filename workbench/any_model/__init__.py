"""Your own model in Workbench: any Flax NNX module (``from_nnx``, a ``ModelSpec``) or a
penzai model (``from_penzai``), planned, searched and trained like Workbench's GPT
(docs/your_model.md); ``MLPClassifier`` is a small example model with its loss. Above
``models`` (which never names it): ``wb.any_model.from_nnx``, ``wb.any_model.from_penzai``, ...

Usage::

    import workbench as wb

    spec = wb.any_model.from_nnx(lambda rngs: MyModel(rngs=rngs), example_batch=..., loss_fn=...)
    plan = wb.plan(spec, mesh=wb.make_mesh(data=2, model=4), batch=16)
"""
from workbench.any_model._mlp import MLPClassifier, classifier_loss
from workbench.any_model._penzai import PENZAI_AXES, from_penzai   # penzai: when called
from workbench.any_model._spec import ModelSpec, from_nnx

__all__ = ["PENZAI_AXES", "MLPClassifier", "ModelSpec", "classifier_loss", "from_nnx",
           "from_penzai"]
