"""`compare` with a stale weight pair: the engine generates with older weights, and the report splits the log
ratio into numerics (engine vs trainer at the older weights) and staleness (trainer now vs then)."""

import jax
import pytest
from flax import nnx

from conftest import build_model
from jaxalign.align.compare import compare
from jaxalign.numerics import NumericPolicy

KW = dict(n_prompts=4, max_new_tokens=8, engine_batches=(4,), seed=0)


def _moved(model, scale=1e-2):
    """A copy of `model` with every weight moved a little (as an update would): the current weights."""
    new = nnx.clone(model)
    state = nnx.state(new)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(new, jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                              if x.dtype.kind == "f" else x for x, k in zip(leaves, keys)]))
    return new


def test_stale_pair_splits_staleness_from_numerics():
    behaviour = build_model("tiny")
    current = _moved(behaviour)
    aligned = NumericPolicy.preset("aligned-bf16")
    run = compare(current, aligned, aligned, behaviour_model=behaviour, **KW)["runs"][0]
    assert run["numerics/k3_kl"] == 0.0 and run["numerics/max_abs_logp_diff"] == 0.0
    assert run["numerics/route_flip_rate"] == 0.0
    assert run["staleness/k3_kl"] > 0.0 and run["staleness/share"] == 1.0
    # the same weights on both sides: no staleness; a misaligned engine: numerics appears
    same = compare(behaviour, NumericPolicy.preset("train-bf16"), NumericPolicy.preset("serve-bf16"),
                   behaviour_model=behaviour, **KW)["runs"][0]
    assert same["staleness/k3_kl"] == 0.0 and same["numerics/k3_kl"] > 0.0
    assert same["numerics/k3_kl"] == same["k3_kl"]  # all of the gap is numerics
    # without a behaviour model the report is as before
    assert not any(k.startswith(("numerics/", "staleness/")) for k in compare(behaviour, aligned, aligned,
                                                                                **KW)["runs"][0])
    with pytest.raises(ValueError, match="same model"):
        compare(current, aligned, aligned, behaviour_model=build_model("tiny-glm5"), **KW)
