"""`pytree_record`: the one way the package registers its records (frozen dataclasses of arrays)
as pytrees, for every module from the ops to the Flax layers.

A field is a leaf (an array or a pytree of them) unless it is declared with `static_field()`:
then it is part of the tree's structure (hashable; a different value is a different tree), e.g. a
plan or a flag. Leaves and static fields keep their declaration order.
"""

from __future__ import annotations

import dataclasses

import jax


def static_field(**kwargs):
    """A dataclass field that is part of the tree's structure, not a leaf."""
    return dataclasses.field(metadata=dict(static=True), **kwargs)


def pytree_record(cls):
    """Registers the dataclass `cls` as a pytree (see the module docstring) and returns it."""
    fields = dataclasses.fields(cls)
    static = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=static)
