"""The layer seam (jaxalign/model/kinds): a toy stateful kind -- a running sum over the tokens, used only here --
proves the engine's promises to a recurrent kind: padding never enters a state (prompts of different lengths in
one right-padded batch, prefilled whole and in chunks) and a continuous-batching slot refilled with a new
request starts from a clean state. Under aligned-bf16 the engine's logprobs then equal the trainer's bitwise;
with either promise broken on purpose they do not (the test can fail)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign import ModelConfig, NumericPolicy, Transformer, generate, token_logprobs
from jaxalign.engine import kernels
from jaxalign.model import kinds
from jaxalign.model.kinds.base import LayerKind
from jaxalign.model.layers import Linear

ALIGNED = NumericPolicy.preset("aligned-bf16")
PROMPTS = [np.arange(1, 1 + n, dtype=np.int32) % 60 + 3 for n in (3, 11, 6, 9, 4)]


class RunningSum(nnx.Module):
    """h_t = h_{t-1} + in_proj(x_t) at each valid token (f32 state [B, D]); out = out_proj(h_t)."""

    def __init__(self, cfg, *, rngs, honour_valid: bool = True):
        self.in_proj = Linear(cfg.d_model, cfg.d_model, ("embed", "unsharded"), rngs=rngs)
        self.out_proj = Linear(cfg.d_model, cfg.d_model, ("unsharded", "embed"), rngs=rngs)
        self.honour_valid = honour_valid

    def __call__(self, x, positions, policy, state=None, *, valid=None, index_replay=None):
        u = self.in_proj(x, policy).astype(jnp.float32)
        b, s, d = u.shape
        keep = jnp.ones((b, s), bool) if valid is None or not self.honour_valid else valid
        start = jnp.zeros((b, d), jnp.float32) if state is None else state

        def step(h, inputs):
            u_t, keep_t = inputs
            h = jnp.where(keep_t[:, None], h + u_t, h)
            return h, h

        final, hs = jax.lax.scan(step, start, (jnp.swapaxes(u, 0, 1), jnp.swapaxes(keep, 0, 1)))
        out = self.out_proj(jnp.swapaxes(hs, 0, 1).astype(x.dtype), policy)
        return out, (None if state is None else final), None


class ToyRunningSum(LayerKind):
    name = "toy_running_sum"
    honour_valid = True

    def build(self, cfg, layer, *, rngs):
        return RunningSum(cfg, rngs=rngs, honour_valid=self.honour_valid)

    def init_state(self, cfg, batch, cache_len, policy):
        return jnp.zeros((batch, cfg.d_model), jnp.float32)


class ToyLeakyRunningSum(ToyRunningSum):
    """The same sum, but adding pad tokens too: what the seam must prevent."""
    name = "toy_leaky_running_sum"
    honour_valid = False


kinds.register(ToyRunningSum())
kinds.register(ToyLeakyRunningSum())


def _model(kind: str) -> Transformer:
    cfg = ModelConfig.preset("tiny").replace(layer_types=(kind, "gqa"))
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _engine_vs_trainer(model, **kw) -> float:
    """Largest |engine logprob - trainer logprob| over the completion tokens of PROMPTS."""
    rollout = generate(model, PROMPTS, ALIGNED, max_new_tokens=5, temperature=0.0, **kw)
    trainer, _ = token_logprobs(model, rollout.tokens, ALIGNED, sampling=rollout.sampling)
    diff = np.abs(np.asarray(trainer) - rollout.logprobs)[rollout.mask]
    assert rollout.mask.sum() == 5 * len(PROMPTS)
    return float(diff.max())


def test_config_validates_layer_types_and_keeps_fingerprints():
    tiny = ModelConfig.preset("tiny")
    assert tiny.layer_kinds == ("gqa", "gqa") and "layer_types" not in tiny.to_dict()
    assert ModelConfig.preset("tiny-glm5").layer_kinds == ("dsa",) * 3
    hybrid = tiny.replace(layer_types=("toy_running_sum", "gqa"))
    assert hybrid.to_dict()["layer_types"] == ["toy_running_sum", "gqa"]
    assert ModelConfig.from_dict(hybrid.to_dict()) == hybrid and hybrid.fingerprint() != tiny.fingerprint()
    with pytest.raises(ValueError, match="unknown layer kind 'lstm'; registered: gqa, mla, dsa"):
        tiny.replace(layer_types=("lstm", "gqa"))
    with pytest.raises(ValueError, match=r"layer_types = \('gqa',\); allowed: None or one kind per layer"):
        tiny.replace(layer_types=("gqa",))
    with pytest.raises(ValueError, match="a 'mla' layer in a model with attention_kind = 'gqa'|an 'mla' layer"):
        tiny.replace(layer_types=("mla", "gqa"))


@pytest.mark.bitwise
def test_pads_never_enter_a_state_and_refilled_slots_start_clean():
    model = _model("toy_running_sum")
    assert kernels.state_bytes(model.config, 4, 32, ALIGNED) == 4 * 32 * 4 + 2 * 4 * 32 * 2 * 8 * 2
    # one right-padded static batch (prompts of 3..11 tokens), prefilled whole and in chunks of 4
    assert _engine_vs_trainer(model) == 0.0
    assert _engine_vs_trainer(model, prefill_chunk=4) == 0.0
    # 5 requests through 2 slots: every slot is refilled, at different steps
    assert _engine_vs_trainer(model, batch_size=2, schedule="continuous") == 0.0


@pytest.mark.bitwise
def test_the_seam_test_fails_when_pads_leak_or_slots_are_not_reset(monkeypatch):
    assert _engine_vs_trainer(_model("toy_leaky_running_sum")) > 0  # pads added to the state
    monkeypatch.setattr(kernels, "_reset", lambda cfg, states, rows: states)
    kernels.run_continuous.clear_cache()  # retrace without the resets
    try:
        assert _engine_vs_trainer(_model("toy_running_sum"), batch_size=2, schedule="continuous") > 0
    finally:
        kernels.run_continuous.clear_cache()
