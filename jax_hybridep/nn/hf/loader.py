"""Loading one MoE layer's HuggingFace tensors into an `nn.MoEBlock` (`load_block`).

`load_block` sets the router (gate, learned logit bias, selection bias), the experts (weights and
biases) and the shared expert (and its sigmoid gate) from a mapping of tensor names to arrays.
Expert parameters are built with `jax.make_array_from_callback` on the block's own sharding, so
each process reads only the experts its devices hold (and, through `nn.hf.checkpoint`'s lazy
safetensors slices, only those bytes from disk). Everything is checked before anything is set:
a missing tensor, a wrong shape or a block/checkpoint mismatch is one ValueError naming them all.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.nn.hf import block_fp8, layouts


def _join(prefix: str, rel: str) -> str:
    prefix = prefix.rstrip(".")
    return f"{prefix}.{rel}" if prefix else rel


def _shape(tensor) -> tuple:
    return tuple(int(d) for d in tensor.shape)


def _linear(rel):  # HF [out, in] -> [in, out]
    return rel, lambda a: np.swapaxes(np.asarray(a), -1, -2)


def _vector(rel):
    return rel, np.asarray


class _Plan:
    """What `load_block` will set: (variable, read) pairs and the problems found on the way.

    With tensors=None it only records the tensors the layout would read (`expected`)."""

    def __init__(self, block, tensors, prefix, layout):
        self.block, self.tensors, self.prefix, self.layout = block, tensors, prefix, layout
        self.sets, self.problems, self.expected = [], [], {}

    def has(self, rel) -> bool:
        if self.tensors is None:
            return False
        return rel is not None and _join(self.prefix, rel) in self.tensors

    def get(self, rel):
        return self.tensors[_join(self.prefix, rel)]

    def expect(self, rel, shape) -> bool:
        name = _join(self.prefix, rel)
        self.expected[name] = tuple(shape)
        if self.tensors is None:
            return True
        if name not in self.tensors:
            self.problems.append(f"missing tensor {name!r}")
            return False
        got = _shape(self.tensors[name])
        if got != tuple(shape):
            self.problems.append(f"tensor {name!r} has shape {got}, expected {tuple(shape)}")
            return False
        return True

    def replicated(self, var, source, shape):
        rel, convert = source
        if self.expect(rel, shape):
            self.sets.append((var, lambda: convert(self.get(rel)[...]), None))

    def extra(self, rel, what: str):
        """A tensor the checkpoint has and the block cannot hold."""
        if self.has(rel):
            self.problems.append(
                f"the checkpoint holds {_join(self.prefix, rel)!r} but the block has no {what}"
            )


def _plan(block, tensors, prefix, layout) -> _Plan:
    plan = _Plan(block, tensors, prefix, layout)
    router = block.router
    d_model, num_experts = router.gate[...].shape
    ffn = block.ffn
    d_ff = block.w_up[...].shape[-1]
    dims = {"H": d_model, "F": d_ff}

    plan.replicated(router.gate, _linear(layout.router), (num_experts, d_model))
    if router.config.logit_bias:
        if layout.logit_bias is None:
            plan.problems.append(
                f"the {layout.name} layout has no router logit bias, but the "
                "block was built with RouterConfig(logit_bias=True)"
            )
        else:
            plan.replicated(router.logit_bias, _vector(layout.logit_bias), (num_experts,))
    else:
        plan.extra(layout.logit_bias, "router logit bias (RouterConfig(logit_bias=True))")
    if layout.selection_bias is not None:
        plan.replicated(router.bias, _vector(layout.selection_bias), (num_experts,))
    else:  # a family without a selection bias selects by the scores alone
        plan.sets.append((router.bias, lambda: np.zeros(num_experts, np.float32), None))

    order = np.arange(num_experts)
    if getattr(block, "placement", None) is not None:
        order = block.placement.storage_order  # stored index -> logical expert
    for name in ffn.names:
        var = getattr(block, name)
        source = layout.experts.get(name)
        if source is None:
            plan.problems.append(
                f"the {layout.name} layout has no {name} (the block's experts "
                f"are {ffn.activation!r}, bias={ffn.bias})"
            )
            continue
        shapes = source.expected(num_experts, tuple(var[...].shape[1:]), dims)
        if all([plan.expect(rel, shape) for rel, shape in shapes.items()]):
            plan.sets.append((var, _expert_reader(plan, source, dims), order))
    for name, source in layout.experts.items():
        if name not in ffn.names:
            first = next(iter(source.expected(num_experts, (1, 1), dims)))
            plan.extra(first, f"{name} (its experts are {ffn.activation!r}, bias={ffn.bias})")

    m, shared = layout.shared, block.shared
    if shared is None:
        plan.extra(m and f"{m}.gate_proj.weight", "shared expert (ExpertConfig(shared_ff=...))")
    elif m is None:
        plan.problems.append(
            f"the {layout.name} layout has no shared expert, but the block "
            "was built with ExpertConfig(shared_ff=...)"
        )
    elif not shared.ffn.gated:
        plan.problems.append(
            f"the {layout.name} layout's shared expert is gated (gate/up/down_proj), the block's "
            f"is {shared.ffn.activation!r}"
        )
    else:
        shared_ff = shared.up[...].shape[-1]
        for var, proj, shape in [
            (shared.gate, "gate_proj", (shared_ff, d_model)),
            (shared.up, "up_proj", (shared_ff, d_model)),
            (shared.down, "down_proj", (d_model, shared_ff)),
        ]:
            plan.replicated(var, _linear(f"{m}.{proj}.weight"), shape)
    gate_var = shared.output_gate if shared is not None else None
    if gate_var is not None:
        if layout.shared_gate is None:
            plan.problems.append(
                f"the {layout.name} layout has no shared expert gate, but the "
                "block was built with ExpertConfig(shared_gate=True)"
            )
        else:
            plan.replicated(gate_var, _linear(layout.shared_gate), (1, d_model))
    else:
        plan.extra(layout.shared_gate, "shared expert gate (ExpertConfig(shared_gate=True))")
    return plan


def _expert_reader(plan, source, dims):
    def read(experts):
        return source.read(plan.get, experts, dims)

    return read


def _materialise(var, read, order):
    """var's value replaced by read's, on var's sharding; expert params read per shard."""
    current = var[...]
    dtype = current.dtype
    if order is None:
        full = np.asarray(read()).astype(dtype)
        if isinstance(current.sharding, jax.sharding.NamedSharding):
            value = jax.make_array_from_callback(current.shape, current.sharding, lambda i: full[i])
        else:  # an unplaced (uncommitted) value, as the block made it: jit places it
            value = jnp.asarray(full)
    else:
        cache = {}

        def shard(index):
            rows = index[0] if index else slice(None)
            key = rows.indices(current.shape[0])
            if key not in cache:
                cache[key] = np.asarray(read(order[rows])).astype(dtype)
            return cache[key][(slice(None), *index[1:])]

        value = jax.make_array_from_callback(current.shape, current.sharding, shard)
    var[...] = value


def _under(tensors, prefix, limit=24) -> list[str]:
    head = _join(prefix, "")
    names = sorted(k[len(head) :] for k in tensors.keys() if k.startswith(head))
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])


def _specificity(layout, has) -> int:
    """How many of a layout's names are present (the most specific present layout wins, so a
    checkpoint's biases are never ignored by a layout that does not know them)."""
    names = list(layout.signature)
    names += [layout.logit_bias, layout.selection_bias, layout.shared_gate]
    names.append(layout.shared and f"{layout.shared}.gate_proj.weight")
    names += [layouts.source_name(source) for source in layout.experts.values()]
    return sum(1 for n in dict.fromkeys(names) if n is not None and has(n))


def _family_layouts(model_type):
    candidates = layouts.FAMILY_LAYOUTS.get(model_type)
    if candidates is None:
        raise ValueError(
            f"unknown model_type {model_type!r}: jax_hybridep.nn.hf knows "
            f"{sorted(layouts.FAMILY_LAYOUTS)}"
        )
    return candidates


def tensor_shapes(block, prefix: str, model_type: str) -> dict[str, tuple[int, ...]]:
    """Every tensor name (under `prefix`) and shape that the family's checkpoint layout holds
    for `block`: what `load_block` reads (e.g. to write a checkpoint of random weights)."""
    plan = _plan(block, None, prefix, _family_layouts(model_type)[0])
    if plan.problems:
        raise ValueError(
            f"block does not fit model_type {model_type!r}: " + "; ".join(plan.problems)
        )
    return plan.expected


def load_block(
    block,
    tensors: Mapping,
    prefix: str,
    *,
    model_type: str | None = None,
    fp8_block: tuple[int, int] = block_fp8.DEFAULT_BLOCK,
) -> str:
    """Sets one MoE layer's parameters of `block` from HuggingFace tensors.

    Args:
      block: an `nn.MoEBlock` built for this family (`hf.block_kwargs`).
      tensors: tensor name -> array (numpy, jax, or anything with `.shape` that slices to
        numpy, e.g. `load_checkpoint`'s lazy safetensors tensors).
      prefix: the layer's MoE module, e.g. "model.layers.3.mlp" (`hf.layer_prefixes`).
      model_type: the family (config.json's model_type); None finds the layout from the names.
      fp8_block: the block of block-scaled FP8 weights (a float8 `{name}` with its
        `{name}_scale_inv`, `nn.hf.block_fp8`): config.json's
        quantization_config.weight_block_size; they load as their dequantized values.

    Returns:
      The name of the layout read.

    Raises:
      ValueError: unknown model_type, no known layout under prefix, or (all at once) missing
        tensors, wrong shapes and tensors the block cannot hold.
    """
    candidates = layouts.ALL_LAYOUTS if model_type is None else _family_layouts(model_type)
    tensors = block_fp8.dequantizing(tensors, fp8_block)

    def has(rel):
        return _join(prefix, rel) in tensors

    present = [layout for layout in candidates if all(has(n) for n in layout.signature)]
    if not present:
        raise ValueError(
            f"no {model_type or 'known'} MoE layout under prefix {prefix!r}; tensors there: "
            f"{_under(tensors, prefix)}; layouts look for: "
            f"{[list(layout.signature) for layout in candidates]}"
        )
    specificity = [_specificity(layout, has) for layout in present]
    plans = [
        _plan(block, tensors, prefix, layout)
        for layout, n in zip(present, specificity, strict=True)
        if n == max(specificity)
    ]
    good = [plan for plan in plans if not plan.problems]
    if len(good) > 1 and all(plan.expected == good[0].expected for plan in good):
        good = good[:1]  # layouts that differ only in what this block does not have
    if len(good) > 1:
        raise ValueError(
            f"the tensors under {prefix!r} fit several layouts ({[p.layout.name for p in good]}): "
            "pass model_type"
        )
    if not good:
        plan = plans[0]
        raise ValueError(
            f"cannot load {prefix!r} as {plan.layout.name}: " + "; ".join(plan.problems)
        )
    plan = good[0]
    for var, read, order in plan.sets:
        _materialise(var, read, order)
    if hasattr(block, "reset_sr_reference"):
        block.reset_sr_reference()  # a persistent SR shared expert follows the new experts
    return plan.layout.name
