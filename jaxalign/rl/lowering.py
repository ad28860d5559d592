"""The RL trainer's update step as StableHLO text, for the precision audit (`jaxalign.align.audit.audit`): the
trainer's own program, lowered on abstract inputs (nothing is compiled or allocated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.numerics import NumericPolicy
from jaxalign.rl.trainer import PROMPT_WIDTH, RLConfig, TrainBatch, make_optimizer, make_update


def lower_update(model, policy: NumericPolicy, config: RLConfig | None = None, *, batch: int = 2) -> str:
    """StableHLO text of the RL trainer's update step (`rl.trainer.make_update`: loss, gradient, clipping, AdamW)
    under `policy`, for `model` and an `RLConfig` (default one). No engine, checkpoint or optimizer state is
    built: the update is lowered on abstract inputs."""
    config = config or RLConfig()
    graphdef, state = nnx.split(model)
    optimizer = make_optimizer(config.learning_rate, config.weight_decay, config.grad_clip,
                               lora_only=bool(config.lora_rank), policy=policy)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    width = PROMPT_WIDTH + config.max_new_tokens
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    train_batch = TrainBatch(tokens=jax.ShapeDtypeStruct((batch, width), jnp.int32), logp_old=f32(batch, width - 1),
                             advantages=f32(batch), weights=f32(batch, width - 1),
                             mask=jax.ShapeDtypeStruct((batch, width - 1), jnp.bool_), replay=None, logp_ref=None)
    update = make_update(graphdef, policy, optimizer, config)
    return jax.jit(update).lower(params, jax.eval_shape(optimizer.init, params), train_batch).as_text()
