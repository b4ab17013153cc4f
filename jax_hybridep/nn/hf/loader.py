"""Loading one MoE layer's HuggingFace tensors into an `nn.MoEBlock`, and safetensors files.

`load_block` sets the router (gate, learned logit bias, selection bias), the experts (weights and
biases) and the shared expert (and its sigmoid gate) from a mapping of tensor names to arrays.
Expert parameters are built with `jax.make_array_from_callback` on the block's own sharding, so
each process reads only the experts its devices hold (and, through `load_checkpoint`'s lazy
safetensors slices, only those bytes from disk). Everything is checked before anything is set:
a missing tensor, a wrong shape or a block/checkpoint mismatch is one ValueError naming them all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jax_hybridep.nn.hf import configs, layouts


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

    modules = [m for m in layout.shared if plan.has(f"{m}.gate_proj.weight")]
    if tensors is None:
        modules = list(layout.shared[:1])
    shared = getattr(block, "shared", None)
    if shared is None:
        for m in modules:
            plan.extra(f"{m}.gate_proj.weight", "shared expert (ExpertConfig(shared_ff=...))")
    elif not modules:
        plan.problems.append(
            f"the block has a shared expert but no shared expert tensors were found under "
            f"{prefix!r} (looked for {[f'{m}.gate_proj.weight' for m in layout.shared]})"
        )
    else:
        m, shared_ff = modules[0], shared.up[...].shape[-1]
        for var, proj, shape in [
            (shared.gate, "gate_proj", (shared_ff, d_model)),
            (shared.up, "up_proj", (shared_ff, d_model)),
            (shared.down, "down_proj", (d_model, shared_ff)),
        ]:
            plan.replicated(var, _linear(f"{m}.{proj}.weight"), shape)
    gate_var = getattr(shared, "sigmoid_gate", None) if shared is not None else None
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
        value = jax.make_array_from_callback(current.shape, current.sharding, lambda i: full[i])
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
    names += [f"{m}.gate_proj.weight" for m in layout.shared]
    for source in layout.experts.values():
        names.append(
            source.template.format(i=0) if isinstance(source, layouts.PerExpert) else source.name
        )
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
        raise ValueError(f"block does not fit model_type {model_type!r}: " + "; ".join(plan.problems))
    return plan.expected


def load_block(block, tensors: Mapping, prefix: str, *, model_type: str | None = None) -> str:
    """Sets one MoE layer's parameters of `block` from HuggingFace tensors.

    Args:
      block: an `nn.MoEBlock` built for this family (`hf.block_kwargs`).
      tensors: tensor name -> array (numpy, jax, or anything with `.shape` that slices to
        numpy, e.g. `load_checkpoint`'s lazy safetensors tensors).
      prefix: the layer's MoE module, e.g. "model.layers.3.mlp" (`hf.layer_prefixes`).
      model_type: the family (config.json's model_type); None finds the layout from the names.

    Returns:
      The name of the layout read.

    Raises:
      ValueError: unknown model_type, no known layout under prefix, or (all at once) missing
        tensors, wrong shapes and tensors the block cannot hold.
    """
    if model_type is not None:
        candidates = layouts.FAMILY_LAYOUTS.get(model_type)
        if candidates is None:
            raise ValueError(
                f"unknown model_type {model_type!r}: jax_hybridep.nn.hf knows "
                f"{sorted(layouts.FAMILY_LAYOUTS)}"
            )
    else:
        candidates = layouts.ALL_LAYOUTS

    def has(rel):
        return _join(prefix, rel) in tensors

    present = [layout for layout in candidates if all(has(n) for n in layout.signature)]
    if not present:
        raise ValueError(
            f"no {model_type or 'known'} MoE layout under prefix {prefix!r}; tensors there: "
            f"{_under(tensors, prefix)}; layouts look for: "
            f"{[list(layout.signature) for layout in candidates]}"
        )
    best = max(_specificity(layout, has) for layout in present)
    plans = [
        _plan(block, tensors, prefix, layout)
        for layout in present
        if _specificity(layout, has) == best
    ]
    good = [plan for plan in plans if not plan.problems]
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


class _LazyTensor:
    """A safetensors tensor read on slicing (`[...]` reads all of it)."""

    def __init__(self, handle, name):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index):
        return self._slice[index]


class Checkpoint(Mapping):
    """Tensor name -> lazy tensor over a set of safetensors files (numpy API, no torch)."""

    def __init__(self, files: Sequence[str], weight_map: Mapping[str, str] | None = None):
        import ml_dtypes  # noqa: F401, PLC0415  (numpy learns "bfloat16" for BF16 slices)
        from safetensors import safe_open  # noqa: PLC0415  (optional dependency: extra "hf")

        self._handles = {}
        self._where = {}
        for path in files:
            handle = safe_open(path, framework="numpy")
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118  (a safe_open handle, not a dict)
                self._where[name] = path
        if weight_map is not None:
            base = os.path.dirname(files[0]) if files else ""
            for name, file in weight_map.items():
                if self._where.get(name) != os.path.join(base, file):
                    raise ValueError(f"the index maps {name!r} to {file!r}, not found there")

    def __getitem__(self, name):
        return _LazyTensor(self._handles[self._where[name]], name)

    def __contains__(self, name):
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def _files(path) -> tuple[list[str], dict | None, dict | None]:
    """(safetensors files, index weight_map, config.json) for a path."""
    if isinstance(path, str | os.PathLike) and os.path.isdir(path):
        path = os.fspath(path)
        config = None
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({os.path.join(path, file) for file in weight_map.values()})
            return files, weight_map, config
        files = sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")
        )
        if not files:
            raise ValueError(f"no .safetensors files in {path!r}")
        return files, None, config
    files = (
        [os.fspath(path)] if isinstance(path, str | os.PathLike) else [os.fspath(p) for p in path]
    )
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"no such safetensors file: {file!r}")
    return files, None, None


def load_checkpoint(path, blocks, *, config: Mapping | None = None) -> dict[str, str]:
    """Loads MoE blocks from a HuggingFace safetensors checkpoint.

    Args:
      path: a checkpoint directory (its *.safetensors, model.safetensors.index.json and
        config.json), one .safetensors file, or a list of them.
      blocks: {layer prefix: MoEBlock}, or the blocks of the model's MoE layers in order (their
        prefixes from the config: `hf.layer_prefixes`).
      config: the parsed config.json (default: the directory's).

    Returns:
      {prefix: layout read}.
    """
    files, weight_map, found = _files(path)
    config = config if config is not None else found
    model_type = configs.model_type(config) if config is not None else None
    if not isinstance(blocks, Mapping):
        blocks = list(blocks)
        if config is None:
            raise ValueError(
                "blocks given as a list need a config (for the layer prefixes): "
                "pass config= or a directory with config.json"
            )
        prefixes = configs.layer_prefixes(config)
        if len(prefixes) != len(blocks):
            raise ValueError(
                f"{len(blocks)} blocks for the {len(prefixes)} MoE layers of this "
                f"{model_type} config ({prefixes[:3]}...)"
            )
        blocks = dict(zip(prefixes, blocks, strict=True))
    tensors = Checkpoint(files, weight_map)
    return {
        prefix: load_block(block, tensors, prefix, model_type=model_type)
        for prefix, block in blocks.items()
    }
