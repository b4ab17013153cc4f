"""The compiled program of the main job: the optimizer, and the jitted train and eval
steps over the (params, rest) split of the model (forward, backward through dispatch/combine's
VJPs, the AdamW update and the router's rule-based state update, in one program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.train_moe.config import TrainConfig
from jax_hybridep import nn as hnn


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (no decay on vectors: norms) under warmup + cosine."""
    steps = cfg.schedule_steps or cfg.steps
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=max(1, min(100, steps // 10)),
        decay_steps=max(steps, 2),
        end_value=cfg.lr * 0.1,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask),
    )


def build_steps(graphdef, tx, state_shardings, replicated):
    """The jitted train step and eval step over the (params, rest) split of the model.

    `state_shardings` (of params, rest, opt_state) pin the updated state to the shardings it came
    in with, so one compiled step serves every iteration and the checkpoint.
    """

    def loss_fn(params, rest, inputs, targets):
        model = nnx.merge(graphdef, params, rest)
        logits, auxes = model(inputs)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        aux = sum(a.loss for a in auxes)
        return ce + aux, (ce, aux, auxes)

    def train_step(params, rest, opt_state, inputs, targets):
        # As jax.value_and_grad; gradient compression's error feedback comes back in `rest`.
        grad_fn = hnn.value_and_grad(loss_fn, has_aux=True)
        (loss, (ce, aux, auxes)), grads, rest = grad_fn(params, rest, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The aux-loss-free router bias follows a rule, not the gradient: update it after.
        model = nnx.merge(graphdef, params, rest)
        model.update_state(auxes)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        metrics = dict(
            loss=loss,
            ce=ce,
            aux=aux,
            grad_norm=optax.tree.norm(grads),
            dropped=sum(a.dropped for a in auxes),
            tokens_per_expert=jnp.stack([a.tokens_per_expert for a in auxes]),
            tokens_per_slot=jnp.stack([a.tokens_per_slot for a in auxes]),
            level_rows=sum(a.level_rows for a in auxes),
        )
        return params, rest, opt_state, metrics

    def eval_step(params, rest, inputs, targets):
        return loss_fn(params, rest, inputs, targets)[1][0]

    train_step = jax.jit(
        train_step, donate_argnums=(0, 1, 2), out_shardings=(*state_shardings, replicated)
    )
    return train_step, jax.jit(eval_step, out_shardings=replicated)
