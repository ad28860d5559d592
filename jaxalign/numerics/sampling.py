"""The distribution a token is sampled from, shared by the engine (to sample and report a logprob) and the
trainer (to score the same token). A frozen `SamplingParams` names it; the engine stores the value it sampled
with in the `Rollout`, and scoring a rollout reads it from there, so the two sides cannot silently disagree.

Semantics: logits are cast to float32 and divided by the temperature; top-k keeps the k largest (ties at the
k-th value are kept); top-p keeps the smallest prefix of tokens, sorted by probability, whose mass reaches p
(the most likely token is always kept). Tokens are drawn from the kept logits, renormalised (`sampling_logprobs`).
The logprob reported for a sampled token (`reported_logprobs`) is an explicit choice, `SamplingParams.logprobs`:
- `renormalized` (default): its entry in the renormalised kept set -- the distribution actually sampled from,
  hence the right denominator for importance ratios (what TRL fixed in trl#6789);
- `raw`: its entry in the temperature-scaled distribution before truncation (what some engines report; with
  top-p 0.8 it puts most tokens' ratios outside [0.9, 1.1] against a renormalised trainer).
Without truncation the two are the same. Greedy decoding (temperature 0) reports the temperature-1 logprob of the
argmax token, without filtering.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxalign.numerics import precision
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import log_softmax


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Host-side validation of sampling parameters."""
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature = {temperature!r}; allowed: a float >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k = {top_k!r}; allowed: None or an int >= 1")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p = {top_p!r}; allowed: None or a float in (0, 1]")


LOGPROB_SEMANTICS = ("renormalized", "raw")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn and which logprob is reported for them (see the module docstring). Frozen and
    hashable: the one static sampling argument of the engine's and the trainer's compiled programs."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    logprobs: str = "renormalized"

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.logprobs not in LOGPROB_SEMANTICS:
            raise ValueError(f"SamplingParams.logprobs = {self.logprobs!r}; allowed: {', '.join(LOGPROB_SEMANTICS)}")
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p can remove tokens from the distribution."""
        return self.temperature != 0 and (self.top_k is not None or (self.top_p is not None and self.top_p < 1))

    @classmethod
    def from_args(cls, sampling: "SamplingParams | None", temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None) -> "SamplingParams":
        """`sampling`, or one built from the temperature/top_k/top_p shorthand (not both)."""
        if sampling is None:
            return cls(temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if temperature is not None or top_k is not None or top_p is not None:
            raise ValueError("give either sampling=SamplingParams(...) or temperature/top_k/top_p, not both")
        return sampling


def reported_logprobs(logits: jax.Array, policy: NumericPolicy, sampling: SamplingParams,
                      sampled: jax.Array | None = None) -> jax.Array:
    """The logprobs [..., V] reported for sampled tokens under `sampling.logprobs` (engine and trainer alike).
    `sampled`: `sampling_logprobs` of the same logits, when the caller has it already."""
    if sampling.logprobs == "raw" and sampling.truncates:
        return sampling_logprobs(logits, policy, sampling.temperature)
    if sampled is not None:
        return sampled
    return sampling_logprobs(logits, policy, sampling.temperature, sampling.top_k, sampling.top_p)


def sampling_logprobs(logits: jax.Array, policy: NumericPolicy, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the distribution sampled from; filtered entries are -inf."""
    x = logits.astype(jnp.float32)
    if temperature == 0:
        return log_softmax(x, policy)
    x = x / jnp.float32(temperature)
    neg_inf = jnp.float32(-jnp.inf)
    if top_k is not None and top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, neg_inf)
    if top_p is not None and top_p < 1.0:
        probs = precision.exp(log_softmax(x, policy), policy)
        order = jnp.argsort(-probs, axis=-1, stable=True)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < jnp.float32(top_p)
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
        x = jnp.where(keep, x, neg_inf)
    return log_softmax(x, policy)
