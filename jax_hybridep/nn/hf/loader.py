"""Loading one MoE layer's HuggingFace tensors into an `nn.MoEBlock` (`load_block`).

`load_block` sets the router (gate, learned logit bias, selection bias), the experts (weights and
biases) and the shared expert (and its sigmoid gate) from a mapping of tensor names to arrays.
Expert parameters are built with `jax.make_array_from_callback` on the block's own sharding, so
each process reads only the experts its devices hold (and, through `nn.hf.checkpoint`'s lazy
safetensors slices, only those bytes from disk). Everything is checked before anything is set:
a missing tensor, a wrong shape or dtype, FP8 scales that do not fit their weight, a tensor under
the layer's prefix that the block cannot hold (a ninth expert, an expert or router bias; unless
`ignore_extra`) or a block/checkpoint mismatch is one ValueError naming them all. Then every new
value is read and built before the first is set, so that a read that fails leaves the block as
it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.nn.hf import block_fp8, families, layer_plan, tensor_layouts
from jax_hybridep.values import is_int, short


def _value(var, read, order):
    """var's new value, read and placed on var's sharding (expert params read per shard)."""
    current = var[...]
    dtype = current.dtype
    if order is None:
        full = np.asarray(read()).astype(dtype)
        if isinstance(current.sharding, jax.sharding.NamedSharding):
            return jax.make_array_from_callback(current.shape, current.sharding, lambda i: full[i])
        return jnp.asarray(full)  # an unplaced (uncommitted) value, as the block made it
    cache = {}

    def shard(index):
        rows = index[0] if index else slice(None)
        key = rows.indices(current.shape[0])
        if key not in cache:
            cache[key] = np.asarray(read(order[rows])).astype(dtype)
        return cache[key][(slice(None), *index[1:])]

    return jax.make_array_from_callback(current.shape, current.sharding, shard)


def _under(tensors, prefix, limit=24) -> list[str]:
    head = layer_plan.join(prefix, "")
    names = sorted(k[len(head) :] for k in tensors.keys() if k.startswith(head))
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])


def _specificity(layout, has) -> int:
    """How many of a layout's names are present (the most specific present layout wins, so a
    checkpoint's biases are never ignored by a layout that does not know them)."""
    names = list(layout.signature)
    names += [layout.logit_bias, layout.selection_bias, layout.shared_gate]
    names.append(layout.shared and f"{layout.shared}.gate_proj.weight")
    names += [tensor_layouts.source_name(source) for source in layout.experts.values()]
    return sum(1 for n in dict.fromkeys(names) if n is not None and has(n))


def _check_block(block, name: str = "block"):
    from jax_hybridep.nn.moe import MoEBlock  # noqa: PLC0415  (nn imports this package)

    if not isinstance(block, MoEBlock):
        raise TypeError(f"{name} must be an nn.MoEBlock, got {type(block).__name__}")


def _check_args(block, tensors, prefix, model_type, fp8_block, ignore_extra) -> tuple[int, int]:
    """TypeError/ValueError naming the first argument of `load_block` that cannot be used;
    fp8_block as a tuple."""
    _check_block(block)
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a mapping of tensor names to arrays, got {type(tensors).__name__}"
        )
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str (e.g. 'model.layers.3.mlp'), got {short(prefix)}")
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"model_type must be a str or None, got {short(model_type)}")
    if (
        isinstance(fp8_block, str | bytes)
        or not isinstance(fp8_block, Sequence)
        or len(fp8_block) != 2
        or not all(is_int(b) and b >= 1 for b in fp8_block)
    ):
        raise ValueError(f"fp8_block must be two block sizes (ints >= 1), got {short(fp8_block)}")
    if not isinstance(ignore_extra, bool):
        raise TypeError(f"ignore_extra must be a bool, got {short(ignore_extra)}")
    return int(fp8_block[0]), int(fp8_block[1])


def tensor_shapes(block, prefix: str, model_type: str) -> dict[str, tuple[int, ...]]:
    """Every tensor name (under `prefix`) and shape that the family's checkpoint layout holds
    for `block`: what `load_block` reads (e.g. to write a checkpoint of random weights)."""
    _check_block(block)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {short(prefix)}")
    plan = layer_plan.plan_layout(block, None, prefix, families.family(model_type).layouts[0])
    if plan.problems:
        raise ValueError(
            f"block does not fit model_type {model_type!r}: " + "; ".join(plan.problems)
        )
    return plan.expected


def plan_block(
    block,
    tensors: Mapping,
    prefix: str,
    *,
    model_type: str | None = None,
    fp8_block: tuple[int, int] = block_fp8.DEFAULT_BLOCK,
    ignore_extra: bool = False,
):
    """What `load_block` would set, every check done and nothing read or set (`apply` sets it);
    ValueError naming every problem."""
    fp8_block = _check_args(block, tensors, prefix, model_type, fp8_block, ignore_extra)
    candidates = families.ALL_LAYOUTS if model_type is None else families.family(model_type).layouts
    raw, tensors = tensors, block_fp8.dequantizing(tensors, fp8_block)

    def has(rel):
        return layer_plan.join(prefix, rel) in tensors

    present = [layout for layout in candidates if all(has(n) for n in layout.signature)]
    if not present:
        raise ValueError(
            f"no {model_type or 'known'} MoE layout under prefix {prefix!r}; tensors there: "
            f"{_under(tensors, prefix)}; layouts look for: "
            f"{[list(layout.signature) for layout in candidates]}"
        )
    specificity = [_specificity(layout, has) for layout in present]
    plans = [
        layer_plan.plan_layout(block, tensors, prefix, layout)
        for layout, n in zip(present, specificity, strict=True)
        if n == max(specificity)
    ]
    if ignore_extra:  # tensors the block cannot hold are left unread
        for plan in plans:
            plan.problems = [p for p in plan.problems if not p.startswith("the checkpoint holds")]
    else:
        for plan in plans:
            extra = layer_plan.extra_tensors(plan, raw)
            if extra:
                shown = extra[:8] + ([f"... ({len(extra) - 8} more)"] if len(extra) > 8 else [])
                plan.problems.append(
                    f"the checkpoint holds tensors under {prefix!r} that the block cannot hold: "
                    f"{shown} (another number of experts, biases the block was not built with? "
                    "ignore_extra=True leaves them unread)"
                )
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
    return good[0]


def apply(plan) -> str:
    """Sets what `plan_block` planned: every value read and built first, then all set (a read
    that fails leaves the block as it was). Returns the layout's name."""
    values = [(var, _value(var, read, order)) for var, read, order in plan.sets]
    for var, value in values:
        var[...] = value
    if hasattr(plan.block, "reset_sr_reference"):
        plan.block.reset_sr_reference()  # a persistent SR shared expert follows the new experts
    return plan.layout.name


def load_block(
    block,
    tensors: Mapping,
    prefix: str,
    *,
    model_type: str | None = None,
    fp8_block: tuple[int, int] = block_fp8.DEFAULT_BLOCK,
    ignore_extra: bool = False,
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
      ignore_extra: leave tensors under `prefix` that the block cannot hold unread (default: a
        ValueError naming them; a block must not drop weights of the checkpoint silently).

    Returns:
      The name of the layout read.

    Raises:
      TypeError: an argument of the wrong type.
      ValueError: unknown model_type, no known layout under prefix, or (all at once) missing
        tensors, wrong shapes or dtypes, scales that do not fit, and tensors the block cannot
        hold; nothing is set then. A read that fails (OSError) also leaves the block as it was.
    """
    plan = plan_block(
        block,
        tensors,
        prefix,
        model_type=model_type,
        fp8_block=fp8_block,
        ignore_extra=ignore_extra,
    )
    return apply(plan)
