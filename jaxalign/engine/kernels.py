"""The engine's compiled programs: static-batch generation (prefill, whole or in chunks -- the whole chunks in a
`lax.fori_loop` -- then a `lax.while_loop` decode) and continuous batching (a fixed set of slots, each advancing
one token per step, refilled inside the loop).

A program is specialised on what sets shapes or numerics (the policy, the batch, the prompt bucket, the cache
length, the sampling settings, the prefill chunk); the number of new tokens and the EOS id are traced operands
(EOS -1 = none: no token id is negative), so runs that differ only in those share one compiled program.

Engine state: one opaque pytree per layer from its kind's `init_state` (`jaxalign.model.kinds`); the programs
never look inside one. Every forward gets `valid` [B, S] (real tokens: prompt padding, finished rows and idle
slots are False) so a recurrent kind leaves its state untouched there, and continuous batching calls each
kind's `reset_state` for the slots it refills, before their first token. Attention caches: a request's token at
position p lives in cache slot p, whatever batch or slot it runs in, so a request's attention reduces over the
same slots in prefill, decode and the trainer's full forward.
Sampling is keyed by (seed, request index, position), so a request gets the same draws wherever it runs.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.model import kinds
from jaxalign.model.routing import RoutingRecord
from jaxalign.numerics import NumericPolicy, dtype
from jaxalign.numerics.sampling import SamplingParams, reported_logprobs, sampling_logprobs
from jaxalign.numerics.schedule import policy_for
from jaxalign.numerics.select import argmax

_THIS_THREAD = threading.local()


def traces_in_this_thread() -> int:
    """How many engine programs this thread has traced (i.e. compiled). Calls in one thread run one after
    another, so the difference across a call is what that call compiled, whatever other threads do."""
    return getattr(_THIS_THREAD, "traces", 0)


def _traced() -> None:
    _THIS_THREAD.traces = traces_in_this_thread() + 1


def _empty_kv(cfg, batch: int, cache_len: int, policy: NumericPolicy) -> list:
    """Every layer's empty engine state (its kind's `init_state`) for `batch` rows of `cache_len` positions."""
    return [kinds.kind_of(cfg, i).init_state(cfg, batch, cache_len, policy) for i in range(cfg.n_layers)]


def _reset(cfg, states: list, rows: jax.Array) -> list:
    """Every layer's state with the rows marked in `rows` [B] back to empty (its kind's `reset_state`); skipped
    (a `lax.cond`) in steps that refill no slot."""
    def reset(states):
        return [kinds.kind_of(cfg, i).reset_state(cfg, s, rows) for i, s in enumerate(states)]
    return jax.lax.cond(jnp.any(rows), reset, lambda states: states, states)


def state_bytes(cfg, batch: int, cache_len: int, policy: NumericPolicy) -> int:
    """Bytes of every layer's engine state for `batch` rows of `cache_len` positions."""
    return sum(kinds.kind_of(cfg, i).state_bytes(cfg, batch, cache_len, policy) for i in range(cfg.n_layers))


def _sample(logits, request_ids, positions, seed, policy, sampling: SamplingParams):
    """One token per row from logits [B, V] and its reported logprob; the key of row b is
    (seed, request_ids[b], positions[b])."""
    lp = sampling_logprobs(logits, policy, sampling.temperature, sampling.top_k, sampling.top_p)
    if sampling.temperature == 0:
        token = argmax(logits.astype(jnp.float32))
    else:
        base = jax.random.key(seed)

        def gumbel(req, pos):
            key = jax.random.fold_in(jax.random.fold_in(base, req), pos)
            return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

        noise = jax.vmap(gumbel)(request_ids, positions)
        token = argmax(lp + noise)
    reported = reported_logprobs(logits, policy, sampling, sampled=lp)
    return token, jnp.take_along_axis(reported, token[:, None], axis=-1)[:, 0]


def _chunked_prefill(model, policy, prompts, lens, kv, routing, chunk: int):
    """Prefill prompts [B, P] `chunk` tokens at a time: (logits [B, V] at each row's last prompt token, kv,
    routing). The whole chunks run in a `lax.fori_loop` (one copy of the model in the program, however many
    chunks), a shorter last chunk after it."""
    b, p = prompts.shape
    rows = jnp.arange(b)

    def part(start, size, carry):
        last, kv, routing = carry
        positions = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (b, size))
        tokens = jax.lax.dynamic_slice_in_dim(prompts, start, size, axis=1)
        logits, record, kv = model.forward(tokens, policy, positions=positions, kv=kv,
                                           valid=positions < lens[:, None])
        routing = routing.written(record, rows[:, None], positions)
        offset = lens - 1 - start  # where each row's last prompt token falls in this chunk, if it does
        inside = (offset >= 0) & (offset < size)
        last = jnp.where(inside[:, None], logits[rows, jnp.clip(offset, 0, size - 1)], last)
        return last, kv, routing

    whole, rest = divmod(p, chunk)
    carry = (jnp.zeros((b, model.config.vocab_size), dtype(policy_for(policy, "head").logits_dtype)), kv, routing)
    carry = jax.lax.fori_loop(0, whole, lambda i, c: part(i * chunk, chunk, c), carry)
    if rest:
        carry = part(whole * chunk, rest, carry)
    return carry


def _finish(routing: RoutingRecord, lens, n_gen) -> RoutingRecord:
    """Mask routing of positions never forwarded: the last generated token, and everything after it."""
    pos = jnp.arange(routing.indices.shape[1])[None, :]
    return routing.masked(pos < (lens + n_gen - 1)[:, None])


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "cache_len", "sampling", "prefill_chunk"))
def run_static(graphdef, state, prompts, lens, request_ids, seed, max_new, eos_id, *, policy, cache_len,
               sampling, prefill_chunk):
    """Generate for one static batch. prompts [B, P] right-padded, lens [B]; max_new (>= 1, at most
    cache_len - P) and eos_id (-1: none) are int32 scalars. Returns (tokens [B, cache_len], logprobs
    [B, cache_len] (entries max_new and beyond are 0), n_generated [B], RoutingRecord [B, cache_len, ...])."""
    _traced()
    model = nnx.merge(graphdef, state)
    cfg = model.config
    b, p = prompts.shape
    kv = _empty_kv(cfg, b, cache_len, policy)
    routing = RoutingRecord.empty(cfg, b, cache_len)
    rows = jnp.arange(b)[:, None]
    if prefill_chunk is None or prefill_chunk >= p:
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        logits, record, kv = model.forward(prompts, policy, positions=positions, kv=kv,
                                           valid=positions < lens[:, None])
        routing = routing.written(record, rows, positions)
        last = logits[jnp.arange(b), lens - 1]
    else:
        last, kv, routing = _chunked_prefill(model, policy, prompts, lens, kv, routing, prefill_chunk)
    sample = functools.partial(_sample, seed=seed, policy=policy, sampling=sampling)
    tok0, lp0 = sample(last, request_ids, lens)
    out_tok = jnp.zeros((b, cache_len), jnp.int32).at[:, 0].set(tok0)
    out_lp = jnp.zeros((b, cache_len), jnp.float32).at[:, 0].set(lp0)
    n_gen = jnp.ones((b,), jnp.int32)
    done = (tok0 == eos_id) | (max_new <= 1)

    def cond(carry):
        step, _, _, _, done, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, out_tok, out_lp, n_gen, done, kv, routing = carry
        positions = (lens + step - 1)[:, None]
        logits, record, kv = model.forward(out_tok[:, step - 1][:, None], policy, positions=positions, kv=kv,
                                           valid=~done[:, None])
        routing = routing.written(record, rows, positions)
        tok, lp = sample(logits[:, 0], request_ids, lens + step)
        active = ~done
        out_tok = out_tok.at[:, step].set(jnp.where(active, tok, 0))
        out_lp = out_lp.at[:, step].set(jnp.where(active, lp, 0.0))
        n_gen = n_gen + active
        done = done | (active & (tok == eos_id)) | (n_gen >= max_new)
        return step + 1, out_tok, out_lp, n_gen, done, kv, routing

    carry = (jnp.int32(1), out_tok, out_lp, n_gen, done, kv, routing)
    _, out_tok, out_lp, n_gen, _, _, routing = jax.lax.while_loop(cond, body, carry)
    return out_tok, out_lp, n_gen, _finish(routing, lens, n_gen)


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "slots", "cache_len", "sampling"))
def run_continuous(graphdef, state, prompts, lens, request_ids, seed, max_new, eos_id, *, policy, slots, cache_len,
                   sampling):
    """Continuous batching over all requests. prompts [R, P] right-padded, lens [R]; max_new and eos_id (-1:
    none) are int32 scalars.

    `slots` rows advance one token per step (a prompt token while a request is in prefill, its last sampled
    token after); a finished request's slot takes the next waiting request inside the loop, so the batch's
    composition changes from step to step. Returns (token buffer [R, cache_len], logprob buffer [R, cache_len]
    (entry p = logprob of the token at position p), n_generated [R], RoutingRecord [R, cache_len, ...]).
    """
    _traced()
    model = nnx.merge(graphdef, state)
    cfg = model.config
    r, p = prompts.shape
    tok_buf = jnp.zeros((r, cache_len), jnp.int32).at[:, :p].set(prompts)
    lp_buf = jnp.zeros((r, cache_len), jnp.float32)
    routing = RoutingRecord.empty(cfg, r, cache_len)
    kv = _empty_kv(cfg, slots, cache_len, policy)
    first = jnp.arange(slots, dtype=jnp.int32)
    slot_req = jnp.where(first < r, first, -1)
    slot_pos = jnp.zeros((slots,), jnp.int32)
    n_gen = jnp.zeros((r,), jnp.int32)
    next_req = jnp.int32(min(slots, r))

    def cond(carry):
        return jnp.any(carry[0] >= 0)

    def body(carry):
        slot_req, slot_pos, next_req, tok_buf, lp_buf, n_gen, kv, routing = carry
        active = slot_req >= 0
        req = jnp.maximum(slot_req, 0)
        target = jnp.where(active, req, r)[:, None]  # row r is out of range: writes dropped
        tokens = tok_buf[req, slot_pos][:, None]
        kv = _reset(cfg, kv, active & (slot_pos == 0))  # a request's first token: its slot starts clean
        logits, record, kv = model.forward(tokens, policy, positions=slot_pos[:, None], kv=kv,
                                           valid=active[:, None])
        routing = routing.written(record, target, slot_pos[:, None])
        emitting = active & (slot_pos >= lens[req] - 1)
        tok, lp = _sample(logits[:, 0], request_ids[req], slot_pos + 1, seed, policy, sampling)
        write = jnp.where(emitting, req, r)
        tok_buf = tok_buf.at[write, slot_pos + 1].set(tok, mode="drop")
        lp_buf = lp_buf.at[write, slot_pos + 1].set(lp, mode="drop")
        generated = n_gen[req] + emitting
        n_gen = n_gen.at[write].set(generated, mode="drop")
        finished = emitting & ((tok == eos_id) | (generated >= max_new))
        rank = jnp.cumsum(finished) - 1
        incoming = next_req + rank
        slot_req = jnp.where(finished, jnp.where(incoming < r, incoming, -1), slot_req)
        slot_pos = jnp.where(active & ~finished, slot_pos + 1, 0)
        next_req = jnp.minimum(next_req + jnp.sum(finished), r)
        return slot_req, slot_pos, next_req, tok_buf, lp_buf, n_gen, kv, routing

    carry = (slot_req, slot_pos, next_req, tok_buf, lp_buf, n_gen, kv, routing)
    _, _, _, tok_buf, lp_buf, n_gen, _, routing = jax.lax.while_loop(cond, body, carry)
    return tok_buf, lp_buf, n_gen, _finish(routing, lens, n_gen)
