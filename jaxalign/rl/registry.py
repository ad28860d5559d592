"""String registries for GRPO's interchangeable parts: advantage estimators and loss aggregations.

`GRPOConfig.advantage` and `GRPOConfig.loss_agg` name an entry here, so a variant is one small module that
registers its parts (`jaxalign/rl/variants/`) and an arm selects it by name (`;advantage=group-mean`). The
built-in parts are registered by `jaxalign.rl.grpo`, the variants by `jaxalign.rl.variants`.

- An advantage estimator: `fn(rewards, group_size) -> float32 [R]`, rewards float64 [R] laid out group after
  group (R a multiple of group_size).
- A loss aggregation: `fn(per_token, mask, policy, max_tokens) -> scalar`, per_token float32 [B, S] (the PPO
  term times the IS weights, plus the KL penalty), mask bool [B, S] (accepted tokens), `policy` the
  `NumericPolicy` whose reductions every sum uses (`jaxalign.numerics.reduce`), `max_tokens` a constant (the
  run's generation budget, `RLConfig.max_new_tokens`, or S when the caller gives none).
"""

from __future__ import annotations

from typing import Callable

ADVANTAGES: dict[str, Callable] = {}
LOSS_AGGREGATIONS: dict[str, Callable] = {}


def _register(table: dict, what: str, name: str) -> Callable:
    def add(fn: Callable) -> Callable:
        if name in table and table[name] is not fn:
            raise ValueError(f"{what} {name!r} is registered already (by {table[name].__module__})")
        table[name] = fn
        return fn
    return add


def register_advantage(name: str) -> Callable:
    """Decorator: register `fn(rewards, group_size)` as the advantage estimator `name`."""
    return _register(ADVANTAGES, "advantage estimator", name)


def register_loss_agg(name: str) -> Callable:
    """Decorator: register `fn(per_token, mask, policy, max_tokens)` as the loss aggregation `name`."""
    return _register(LOSS_AGGREGATIONS, "loss aggregation", name)
