"""Sharding: named meshes, block geometry, logical-axis rules, the default placement.

A private package (``wb.make_mesh``, ``wb.layout``, ``wb.Rules`` are its public names):
``mesh`` (named and abstract meshes, ``MeshInfo``) -> ``topology`` (the TPU compiler's
compile-only devices) and ``layouts`` (shape, dtype, sharding -> per-device blocks) ->
``pytrees`` (the layouts of a whole pytree); ``tracing`` (the one context traced model code
reads) -> ``rules`` (logical axis names -> mesh axes) -> ``placement`` (the one default mesh
and rules). It sits low: it imports only ``hardware`` and the root's ``_display`` and
``_validate``. Importing it imports none of its modules.
"""
