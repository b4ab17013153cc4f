"""The tensor layouts of HuggingFace MoE checkpoints, generically: which tensors hold a layer's
router, experts, biases and shared expert (`TensorLayout`; not a dispatch's layout, the rows of
docs/design.md §2.1.2-3), and how each expert tensor becomes one of the block's parameters
(`PerExpert`, `Fused`, `Mxfp4`). Each family's own layouts are in its file under
`nn.hf.families`; what several families share is here: transformers' per-expert gate/up/down_proj
and its in-memory stacked layout, and the [in, out] fused gate_up of Llama-4 and GPT-OSS
(`fused_in_out`).

Names are relative to the layer's MoE module (e.g. "model.layers.3.mlp"). HF linear weights are
stored [out, in]; the block's are [in, out], experts stacked [E, in, out]. A `PerExpert` source is
one tensor per expert (Mixtral, Qwen, DeepSeek, ...); a `Fused` one holds every expert along its
first axis (DBRX, Granite-MoE, Llama-4, GPT-OSS, transformers' in-memory "stacked" layout), so
any set of experts is read as slices of it: a loader that reads lazily (safetensors) reads only
those experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np


def in_out(a):
    """[n, out, in] -> [n, in, out]."""
    return np.swapaxes(a, -1, -2)


@dataclasses.dataclass(frozen=True)
class PerExpert:
    """One tensor per expert: `template` with {i}; `transpose`: HF [out, in] -> [in, out]."""

    template: str
    transpose: bool = True

    def expected(self, num_experts: int, per_expert: tuple, dims: Mapping) -> dict[str, tuple]:
        """Every tensor it reads -> its expected shape."""
        shape = per_expert[::-1] if self.transpose else per_expert
        return {self.template.format(i=i): shape for i in range(num_experts)}

    def read(self, get: Callable, experts: Sequence[int], dims: Mapping) -> np.ndarray:
        arrays = [np.asarray(get(self.template.format(i=int(e)))[...]) for e in experts]
        stacked = np.stack(arrays)
        return in_out(stacked) if self.transpose else stacked


@dataclasses.dataclass(frozen=True)
class Fused:
    """One tensor, `rows(dims)` rows per expert on its first axis; `stored(E, dims)` its shape;
    `take(a, dims)` turns the rows of n experts (concatenated) into the block's [n, ...]."""

    name: str
    stored: Callable[[int, Mapping], tuple]
    take: Callable[[np.ndarray, Mapping], np.ndarray]
    rows: Callable[[Mapping], int] = lambda dims: 1

    def expected(self, num_experts: int, per_expert: tuple, dims: Mapping) -> dict[str, tuple]:
        """Every tensor it reads -> its expected shape."""
        return {self.name: self.stored(num_experts, dims)}

    def read(self, get: Callable, experts: Sequence[int], dims: Mapping) -> np.ndarray:
        tensor, r = get(self.name), self.rows(dims)
        parts = [np.asarray(tensor[int(e) * r : (int(e) + 1) * r]) for e in experts]
        return self.take(np.concatenate(parts), dims)


# MXFP4 (OCP microscaling FP4): each byte holds two E2M1 values, the low nibble first; every 32
# values along the input axis share one E8M0 scale, 2^(scale - 127).
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_dequantize(blocks, scales) -> np.ndarray:
    """blocks [n, out, G, 16] uint8, scales [n, out, G] uint8 -> [n, in = 32 G, out] float32
    (transposed to the [in, out] of the dense layout)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    values = np.stack([_E2M1[blocks & 0x0F], _E2M1[blocks >> 4]], axis=-1)  # [n, out, G, 16, 2]
    values = values.reshape(*scales.shape, 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return in_out(values.reshape(*scales.shape[:-1], -1))


@dataclasses.dataclass(frozen=True)
class Mxfp4:
    """A fused [E, out, in] weight stored as MXFP4 `{name}_blocks` [E, out, in/32, 16] and
    `{name}_scales` [E, out, in/32] (GPT-OSS's released files); `take` as in `Fused`, on the
    dequantized [n, in, out]. `out(dims)`, `inp(dims)`: the stored weight's dims."""

    name: str
    out: Callable[[Mapping], int]
    inp: Callable[[Mapping], int]
    take: Callable[[np.ndarray, Mapping], np.ndarray]

    @property
    def blocks(self) -> str:
        return f"{self.name}_blocks"

    def expected(self, num_experts: int, per_expert: tuple, dims: Mapping) -> dict[str, tuple]:
        """Every tensor it reads -> its expected shape."""
        out, groups = self.out(dims), self.inp(dims) // 32
        return {
            self.blocks: (num_experts, out, groups, 16),
            f"{self.name}_scales": (num_experts, out, groups),
        }

    def read(self, get: Callable, experts: Sequence[int], dims: Mapping) -> np.ndarray:
        blocks, scales = get(self.blocks), get(f"{self.name}_scales")
        picked = [(blocks[int(e) : int(e) + 1], scales[int(e) : int(e) + 1]) for e in experts]
        dense = mxfp4_dequantize(*(np.concatenate(part) for part in zip(*picked, strict=True)))
        return self.take(dense, dims)


def _cat_gate(a, d):  # [n, 2F, H], gate rows first -> [n, H, F]
    return in_out(a[:, : d["F"]])


def _cat_up(a, d):
    return in_out(a[:, d["F"] :])


def stacked(gate_up: str, down: str) -> dict:
    """Gated experts fused as transformers holds them in memory (and as Granite-MoE's files do):
    gate_up [E, 2F, H] (gate rows first), down [E, H, F]."""
    return {
        "w_gate": Fused(gate_up, lambda e, d: (e, 2 * d["F"], d["H"]), _cat_gate),
        "w_up": Fused(gate_up, lambda e, d: (e, 2 * d["F"], d["H"]), _cat_up),
        "w_down": Fused(down, lambda e, d: (e, d["H"], d["F"]), lambda a, d: in_out(a)),
    }


def _first_half(a, d):  # [..., 2F] -> its first F columns
    return a[..., : d["F"]]


def _second_half(a, d):
    return a[..., d["F"] :]


def even_columns(a, d):  # [..., 2F] -> columns 0, 2, 4, ... (GPT-OSS's gate)
    return a[..., 0::2]


def odd_columns(a, d):  # columns 1, 3, 5, ... (GPT-OSS's up)
    return a[..., 1::2]


def _as_is(a, d):
    return a


def fused_in_out(gate_up: str, down: str, *, interleaved: bool) -> dict:
    """Gated experts fused and stored [in, out] as Llama-4 and GPT-OSS hold them: gate_up
    [E, H, 2F] (gate columns first, or with `interleaved` gate in the even and up in the odd
    columns), down [E, F, H]."""
    gate, up = (even_columns, odd_columns) if interleaved else (_first_half, _second_half)
    shape = lambda e, d: (e, d["H"], 2 * d["F"])  # noqa: E731
    return {
        "w_gate": Fused(gate_up, shape, gate),
        "w_up": Fused(gate_up, shape, up),
        "w_down": Fused(down, lambda e, d: (e, d["F"], d["H"]), _as_is),
    }


def per_expert(gate: str, up: str, down: str) -> dict:
    """Gated experts, one tensor per expert for each of gate, up, down ({i}: the expert)."""
    return {"w_gate": PerExpert(gate), "w_up": PerExpert(up), "w_down": PerExpert(down)}


def source_name(source) -> str:
    """The first tensor a source reads (expert 0's for per-expert sources)."""
    if isinstance(source, PerExpert):
        return source.template.format(i=0)
    return source.blocks if isinstance(source, Mxfp4) else source.name


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One family's tensor names under a layer's MoE module.

    Attributes:
      name: what to call it in messages.
      router: the gate weight [E, H].
      experts: the block's expert parameter name -> its source.
      logit_bias: the router's learned bias [E], if the family has one.
      selection_bias: the auxiliary-loss-free selection bias [E] (DeepSeek-V3's
        e_score_correction_bias), if the family has one (then it is required).
      shared: the shared expert's module name (gate_proj/up_proj/down_proj in it), if the family
        may have one.
      shared_gate: the shared expert's sigmoid gate weight [1, H], if the family has one.
    """

    name: str
    router: str
    experts: Mapping
    logit_bias: str | None = None
    selection_bias: str | None = None
    shared: str | None = None
    shared_gate: str | None = None

    @property
    def signature(self) -> tuple[str, ...]:
        """Tensors whose presence says the layout is this one (expert 0's, for per-expert)."""
        first = [source_name(src) for src in self.experts.values()]
        return (self.router, *dict.fromkeys(first))


# transformers' common names: per-expert gate/up/down_proj, and the in-memory stacked layout that
# transformers 5 builds from them when it loads them (so the per-expert families read both). The
# shared expert's names are Qwen2-MoE's (a block without a shared expert names such tensors as
# ones it cannot hold).
_QWEN_SHARED = dict(shared="shared_expert", shared_gate="shared_expert_gate.weight")
PER_EXPERT = TensorLayout(
    "per-expert gate/up/down_proj",
    "gate.weight",
    per_expert(
        "experts.{i}.gate_proj.weight", "experts.{i}.up_proj.weight", "experts.{i}.down_proj.weight"
    ),
    **_QWEN_SHARED,
)
STACKED = TensorLayout(
    "stacked gate_up_proj [E, 2F, H]",
    "gate.weight",
    stacked("experts.gate_up_proj", "experts.down_proj"),
    **_QWEN_SHARED,
)
