"""The experts' settings (`ExpertConfig`) and their per-shard computation over expert-major rows
(the output of `dispatch`).

`group_sizes[e]` consecutive rows belong to local expert e, packed from row 0; rows after the
last group are padding. On GPUs the experts run as `jax.lax.ragged_dot`. On CPU `ragged_dot`
lowers to a dense masked computation (E_local x the FLOPs and memory), so with a capacity each
expert instead runs over a window of `capacity` rows starting at its group (docs/design.md §5).

The expert FFN (`FFN`): gated activations take (w_gate, w_up, w_down) -- "swiglu"
`silu(x Wg) * (x Wu)` and GPT-OSS's "clamped_swiglu" `(clip(x Wu, ±limit) + 1) * g sigmoid(alpha g)`
with `g = min(x Wg, limit)`; non-gated ones take (w_up, w_down) -- "relu", "gelu" (erf) and
"gelu_tanh" `act(x Wu)`. With biases each projection adds its own (b_gate, b_up: [F]; b_down: [H]).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_hybridep import compat
from jax_hybridep.values import check_bool, check_int, check_real

GATED_ACTIVATIONS = ("swiglu", "clamped_swiglu")
ACTIVATIONS = GATED_ACTIVATIONS + ("relu", "gelu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class FFN:
    """The expert feed-forward rule (hashable; a static argument).

    Attributes:
      activation: one of ACTIVATIONS.
      limit: "clamped_swiglu"'s clamp (GPT-OSS's swiglu_limit).
      alpha: "clamped_swiglu"'s sigmoid slope.
      bias: whether each projection has a bias.
    """

    activation: str = "swiglu"
    limit: float = 7.0
    alpha: float = 1.702
    bias: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        check_real("limit", self.limit, positive=True)
        check_real("alpha", self.alpha, positive=True)
        check_bool("bias", self.bias)

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def names(self) -> tuple[str, ...]:
        """The expert's parameters, in the order every function here takes them."""
        weights = ("w_gate", "w_up", "w_down") if self.gated else ("w_up", "w_down")
        if not self.bias:
            return weights
        return weights + tuple("b" + name[1:] for name in weights)

    def shapes(self, d_model: int, d_ff: int) -> dict[str, tuple[int, ...]]:
        """Per-expert shape of each parameter."""
        table = {
            "w_gate": (d_model, d_ff),
            "w_up": (d_model, d_ff),
            "w_down": (d_ff, d_model),
            "b_gate": (d_ff,),
            "b_up": (d_ff,),
            "b_down": (d_model,),
        }
        return {name: table[name] for name in self.names}

    def hidden(self, up, gate=None):
        """The activation of the pre-activations up [.., F] (and gate [.., F] when gated)."""
        a = self.activation
        if a == "swiglu":
            return jax.nn.silu(gate) * up
        if a == "clamped_swiglu":
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
            return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
        if a == "relu":
            return jax.nn.relu(up)
        return jax.nn.gelu(up, approximate=a == "gelu_tanh")

    def __call__(self, x, *params):
        """One expert (or a shared expert) on x [N, H]: params in `names` order -> [N, H']."""
        p = dict(zip(self.names, params, strict=True))

        def proj(name, h):
            y = jnp.dot(h, p["w_" + name])
            return y + p["b_" + name] if self.bias else y

        gate = proj("gate", x) if self.gated else None
        return proj("down", self.hidden(proj("up", x), gate))


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    """What each routed expert (and the optional always-on shared expert) is.

    Attributes:
      d_ff: each routed expert's hidden width F.
      shared_ff: hidden width of an always-on shared expert applied to every token, or None
        for none.
      dtype: compute dtype of the experts (the dispatched rows travel in it); a floating dtype.
      param_dtype: dtype the expert (and router) parameters are stored in; a floating dtype.
      activation: the experts' FFN (`ACTIVATIONS`): "swiglu", GPT-OSS's "clamped_swiglu", or
        non-gated "relu", "gelu", "gelu_tanh" (no w_gate). The shared expert uses it too.
      glu_limit, glu_alpha: "clamped_swiglu"'s clamp and sigmoid slope (GPT-OSS: 7.0, 1.702).
      expert_bias: each expert projection has a bias (b_gate, b_up [E, F], b_down [E, H];
        GPT-OSS, NLLB-MoE); the shared expert has none.
      shared_gate: the shared expert's output is scaled per token by sigmoid(x @ w [H, 1])
        (Qwen2-MoE); needs shared_ff.
      weight_input: the routing weight scales each row before its expert and the outputs are
        combined unweighted (Llama-4), instead of weighting the outputs.
    """

    d_ff: int
    shared_ff: int | None = None
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    activation: str = "swiglu"
    glu_limit: float = 7.0
    glu_alpha: float = 1.702
    expert_bias: bool = False
    shared_gate: bool = False
    weight_input: bool = False

    def __post_init__(self):
        check_int("ExpertConfig.d_ff", self.d_ff, 1)
        if self.shared_ff is not None:
            check_int("ExpertConfig.shared_ff", self.shared_ff, 1)
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, _floating(f"ExpertConfig.{name}", getattr(self, name)))
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ExpertConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        check_real("ExpertConfig.glu_limit", self.glu_limit, positive=True)
        check_real("ExpertConfig.glu_alpha", self.glu_alpha, positive=True)
        for name in ("expert_bias", "shared_gate", "weight_input"):
            check_bool(f"ExpertConfig.{name}", getattr(self, name))
        if self.shared_gate and self.shared_ff is None:
            raise ValueError("ExpertConfig.shared_gate=True gates a shared expert: set shared_ff")

    @property
    def ffn(self) -> FFN:
        """The routed experts' rule."""
        return FFN(self.activation, self.glu_limit, self.glu_alpha, self.expert_bias)

    @property
    def shared_ffn(self) -> FFN:
        """The shared expert's rule (the same activation, no biases)."""
        return FFN(self.activation, self.glu_limit, self.glu_alpha, False)


def _floating(name: str, value) -> jnp.dtype:
    """value as a floating jnp dtype (TypeError otherwise)."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype (e.g. jnp.bfloat16), got {value!r}")
    return dtype


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU FFN: (silu(x @ w_gate) * (x @ w_up)) @ w_down."""
    return FFN()(x, w_gate, w_up, w_down)


def _row_experts(group_sizes, num_rows):
    """[C] int32: the local expert of each row (len(group_sizes) for rows past the groups)."""
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=jnp.int32), side="right")


def _ragged(ffn, rows, group_sizes, params):
    p = dict(zip(ffn.names, params, strict=True))
    num_local = group_sizes.shape[0]
    expert = _row_experts(group_sizes, rows.shape[0])
    in_group = (expert < num_local)[:, None]
    expert = jnp.minimum(expert, num_local - 1)

    def proj(name, h):
        y = jax.lax.ragged_dot(h, p["w_" + name], group_sizes)
        return y + p["b_" + name].astype(y.dtype)[expert] if ffn.bias else y

    gate = proj("gate", rows) if ffn.gated else None
    out = proj("down", ffn.hidden(proj("up", rows), gate))
    # ragged_dot gives 0 past the groups; a bias would not: keep those rows 0 (by a select, so
    # no gradient reaches the biases from them).
    return jnp.where(in_group, out, 0) if ffn.bias else out


def _windowed(ffn, rows, group_sizes, params, capacity):
    """Each expert over `capacity` rows from its group's start; rows outside its group give 0."""
    num_rows = rows.shape[0]
    # Windows may run past the last row: pad so dynamic_slice never shifts a window back.
    padded = jnp.concatenate([rows, jnp.zeros((capacity, rows.shape[1]), rows.dtype)])
    starts = jnp.cumsum(group_sizes, dtype=jnp.int32) - group_sizes
    out = jnp.zeros((num_rows + capacity, params[ffn.names.index("w_down")].shape[-1]), rows.dtype)
    varying = frozenset().union(*(compat.varying_axes(a) for a in (rows, *params)))
    out = compat.mark_varying(out, varying)  # the scan carry must vary like what it absorbs

    def one_expert(out, per_expert):
        start, size, *weights = per_expert
        mine = (jnp.arange(capacity) < size)[:, None]
        # Rows past the group (the next group's, or unspecified padding that may be NaN) are
        # selected away before and after the expert, so neither its output nor its gradient
        # ever reads them.
        window = jnp.where(mine, jax.lax.dynamic_slice_in_dim(padded, start, capacity), 0)
        y = jnp.where(mine, ffn(window, *weights), 0).astype(out.dtype)
        # Experts go in ascending order and each group starts where the previous one ends, so a
        # window's tail (zeros) is overwritten by the next expert's rows.
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=0), None

    out, _ = jax.lax.scan(one_expert, out, (starts, group_sizes, *params))
    return out[:num_rows]


def expert_ffn(rows, group_sizes, params, *, ffn: FFN, capacity=None, platform="cpu"):
    """`ffn` of each local expert over its rows.

    Args:
      rows: [C, H] expert-major rows.
      group_sizes: [L] int32 rows per local expert.
      params: the local experts' parameters in `ffn.names` order, each [L, *per-expert shape]
        (`FFN.shapes`), in rows' dtype.
      ffn: the expert rule.
      capacity: rows per expert when the dispatch had a capacity (enables the CPU window path).
      platform: "cpu" or an accelerator platform name.

    Returns:
      [C, H'] in rows' dtype; rows past the groups are 0.
    """
    params = tuple(params)
    if platform == "cpu" and capacity is not None:
        return _windowed(ffn, rows, group_sizes, params, capacity)
    return _ragged(ffn, rows, group_sizes, params).astype(rows.dtype)


def expert_swiglu(rows, group_sizes, w_gate, w_up, w_down, *, capacity=None, platform="cpu"):
    """SwiGLU of each local expert over its rows (`expert_ffn` with the default FFN).

    Args:
      rows: [C, H] expert-major rows.
      group_sizes: [L] int32 rows per local expert.
      w_gate, w_up: [L, H, F]; w_down: [L, F, H'].
      capacity: rows per expert when the dispatch had a capacity (enables the CPU window path).
      platform: "cpu" or an accelerator platform name.

    Returns:
      [C, H'] in rows' dtype; padding rows are 0.
    """
    return expert_ffn(
        rows, group_sizes, (w_gate, w_up, w_down), ffn=FFN(), capacity=capacity, platform=platform
    )
