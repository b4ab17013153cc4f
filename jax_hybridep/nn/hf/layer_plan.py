"""What `load_block` reads and sets for one MoE layer in one layout (`nn.hf.tensor_layouts`): the
plan of (variable, read) pairs, the tensors it expects (names, shapes, dtypes) and the problems
found while making it, before anything is read or set.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jax_hybridep.nn.hf import block_fp8, tensor_layouts


def join(prefix: str, rel: str) -> str:
    prefix = prefix.rstrip(".")
    return f"{prefix}.{rel}" if prefix else rel


def shape_of(tensor) -> tuple:
    return tuple(int(d) for d in tensor.shape)


def _linear(rel):  # HF [out, in] -> [in, out]
    return rel, lambda a: np.swapaxes(np.asarray(a), -1, -2)


def _vector(rel):
    return rel, np.asarray


def dtype_kind(dtype) -> str | None:
    """ "float" (a weight: float16/32/64, bfloat16, or float8 read with its scales), "uint8"
    (MXFP4 blocks and scales), else the dtype's name; None when unknown (no dtype attribute)."""
    if dtype is None:
        return None
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
        return "float"
    return dtype.name


class Plan:
    """What `load_block` will set: (variable, read) pairs and the problems found on the way.

    With tensors=None it only records the tensors the layout would read (`expected`)."""

    def __init__(self, block, tensors, prefix, layout):
        self.block, self.tensors, self.prefix, self.layout = block, tensors, prefix, layout
        self.sets, self.problems, self.expected = [], [], {}
        self.named_extra: set[str] = set()  # tensors `extra` named already

    def has(self, rel) -> bool:
        if self.tensors is None:
            return False
        return rel is not None and join(self.prefix, rel) in self.tensors

    def get(self, rel):
        return self.tensors[join(self.prefix, rel)]

    def expect(self, rel, shape, kind: str = "float") -> bool:
        """Whether tensor `rel` is there with `shape` and dtype `kind` (`_kind`); a problem
        naming it otherwise."""
        name = join(self.prefix, rel)
        self.expected[name] = tuple(shape)
        if self.tensors is None:
            return True
        if name not in self.tensors:
            self.problems.append(f"missing tensor {name!r}")
            return False
        try:
            tensor = self.tensors[name]  # FP8 scales are checked here (block_fp8)
        except ValueError as err:
            self.problems.append(str(err))
            return False
        got = shape_of(tensor)
        if got != tuple(shape):
            self.problems.append(f"tensor {name!r} has shape {got}, expected {tuple(shape)}")
            return False
        have = dtype_kind(getattr(tensor, "dtype", None))
        if have is not None and have != kind:
            want = "a float dtype" if kind == "float" else kind
            self.problems.append(
                f"tensor {name!r} is {np.dtype(tensor.dtype).name}, expected {want} (a "
                "quantisation this loader does not read?)"
            )
            return False
        return True

    def replicated(self, var, source, shape):
        rel, convert = source
        if self.expect(rel, shape):
            self.sets.append((var, lambda: convert(self.get(rel)[...]), None))

    def extra(self, rel, what: str):
        """A tensor the checkpoint has and the block cannot hold."""
        if self.has(rel):
            self.named_extra.add(join(self.prefix, rel))
            self.problems.append(
                f"the checkpoint holds {join(self.prefix, rel)!r} but the block has no {what}"
            )


def plan_layout(block, tensors, prefix, layout) -> Plan:
    plan = Plan(block, tensors, prefix, layout)
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
        kind = "uint8" if isinstance(source, tensor_layouts.Mxfp4) else "float"
        if all([plan.expect(rel, shape, kind) for rel, shape in shapes.items()]):
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


def extra_tensors(plan, raw: Mapping) -> list[str]:
    """Tensors under the layer's prefix that the plan does not read (and `extra` did not name):
    their FP8 scales count as read with their weights."""
    head = join(plan.prefix, "")
    used = set(plan.expected) | plan.named_extra
    used |= {name + block_fp8.SCALE_SUFFIX for name in used}
    return sorted(k for k in raw.keys() if k.startswith(head) and k not in used)
