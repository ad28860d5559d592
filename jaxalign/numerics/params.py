"""Parameters as a policy uses them: the one cast at weight sync (dtypes, and FP8 block quantisation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics import fp8
from jaxalign.numerics.dtypes import ROUTER_PARAMS, cast
from jaxalign.numerics.policy import NumericPolicy


def _module_path(names: tuple[str, ...]) -> tuple[str, ...]:
    """A state path's names up to the parameter (nnx puts the Variable's `value` after it)."""
    return names[:-1] if names and names[-1] == "value" else names


def cast_params(state, policy: NumericPolicy):
    """Cast every floating leaf of a parameter pytree to the policy's param dtype (done once, at weight sync);
    router parameters go to the router dtype instead (see `moe.route`). Under `weight_quant=e4m3:RxC` linear
    and expert weights become `fp8.QuantizedWeight`s, quantised from the float32 masters (re-done at every sync,
    so no quantised copy outlives the weights it came from)."""
    def one(path, x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        path_names = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        quantized = fp8.cast_weight(x, _module_path(path_names), policy)
        if quantized is not None:
            return quantized
        names = set(path_names)
        return cast(x, policy.router_logits_dtype if names & set(ROUTER_PARAMS) else policy.param_dtype)
    return jax.tree_util.tree_map_with_path(one, state)
