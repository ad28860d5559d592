"""Expert dispatch and combine under a NumericPolicy.

Dispatch decides which rows each expert's matmuls see (this changes the matmul shapes, hence XLA's bits, and
with a capacity, which tokens are dropped). Combine decides the precision and order in which the k weighted
expert outputs of a token are summed -- the seed's Qwen finding lives here.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics import fp8, precision
from jaxalign.numerics.matmul import expert_matmul, gathered_matmul, grouped_matmul
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.dtypes import as_compute, cast, dtype, dtype_name
from jaxalign.numerics.reduce import divide_by, reduce_sum, tree_broadcast


def sigmoid(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """sigmoid computed in float32 and rounded once to x's dtype (as torch's bf16 sigmoid), at the policy's
    `transcendental_accuracy`."""
    return precision.logistic(x.astype(jnp.float32), policy).astype(x.dtype)


def router_sigmoid(logits: jax.Array, policy: NumericPolicy) -> jax.Array:
    """A sigmoid router's scores: the logits cast to `router_softmax_dtype` and the sigmoid computed in that dtype
    (transformers' GLM-4.5 / DeepSeek-V3 routers compute it in float32), at the policy's
    `transcendental_accuracy`."""
    return precision.logistic(cast(logits, policy.router_softmax_dtype), policy)


def normalize_gate_weights(weights: jax.Array, policy: NumericPolicy, *, renormalize: bool,
                           epsilon: float | None = None, scale: float | None = None) -> jax.Array:
    """The family's gate-weight normalisation of top-k scores [N, k]: divided by their sum when `renormalize`
    (the sum in the policy's reduction order, plus `epsilon` when given: DeepSeek-V3's 1e-20), then times
    `scale` when given (DeepSeek-V3's routed_scaling_factor). Computed in the weights' dtype."""
    if renormalize:
        denom = reduce_sum(weights, policy, axis=-1, keepdims=True)
        if epsilon is not None:
            denom = denom + jnp.asarray(epsilon, weights.dtype)
        weights = divide_by(weights, denom, -1, policy)
    if scale is not None:
        weights = weights * jnp.asarray(scale, weights.dtype)
    return weights


def swiglu(gate: jax.Array, up: jax.Array, policy: NumericPolicy) -> jax.Array:
    """silu(gate) * up. The activation (gate * sigmoid(gate), the sigmoid at the policy's
    `transcendental_accuracy`) is computed in float32 and rounded once to gate's dtype (as fused kernels and
    torch's bf16 silu do), then multiplied by `up` in that dtype."""
    g = gate.astype(jnp.float32)
    return (g * precision.logistic(g, policy)).astype(gate.dtype) * up


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' `GptOssExperts._apply_gate`): gate clamped above at `limit`, up
    to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


def clamped_swiglu(gate: jax.Array, up: jax.Array, act: ClampedSwiGLU, policy: NumericPolicy) -> jax.Array:
    """`ClampedSwiGLU` op by op as torch runs it in gate's dtype: each of gate * alpha, its sigmoid (in float32,
    at the policy's `transcendental_accuracy`), gate * sigmoid, up + 1 and the final product computed in float32
    and rounded to that dtype (a no-op in float32)."""
    name = dtype_name(gate.dtype)
    limit = jnp.asarray(act.limit, gate.dtype)
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    g = gate.astype(jnp.float32)
    scaled = cast(g * jnp.float32(act.alpha), name).astype(jnp.float32)
    glu = cast(g * cast(precision.logistic(scaled, policy), name).astype(jnp.float32), name)
    return cast(cast(up.astype(jnp.float32) + 1.0, name).astype(jnp.float32) * glu.astype(jnp.float32), name)


@dataclasses.dataclass(frozen=True)
class LimitedSwiGLU:
    """DeepSeek-V4's expert activation (transformers' `DeepseekV4Experts._apply_gate` and `DeepseekV4MLP`): SwiGLU
    with gate clamped above at `limit` and up to [-limit, limit] (clamps are exact: `swiglu` of the clamped)."""

    limit: float


def gated(gate: jax.Array, up: jax.Array, policy: NumericPolicy,
          act: ClampedSwiGLU | LimitedSwiGLU | None = None) -> jax.Array:
    """The experts' gated activation: SwiGLU, gpt-oss's clamped form (`ClampedSwiGLU`) or DeepSeek-V4's limited
    one (`LimitedSwiGLU`) when `act` is given."""
    if act is None:
        return swiglu(gate, up, policy)
    if isinstance(act, LimitedSwiGLU):
        limit = jnp.asarray(act.limit, gate.dtype)
        return swiglu(jnp.minimum(gate, limit), jnp.clip(up, -limit, limit), policy)
    return clamped_swiglu(gate, up, act, policy)


def router_sqrtsoftplus(logits: jax.Array, policy: NumericPolicy) -> jax.Array:
    """DeepSeek-V4's router scores sqrt(softplus(logits)), in `router_softmax_dtype` (transformers' float32
    `SqrtSoftplusActivation`; torch's softplus returns x itself above 20, where log1p(exp(x)) differs from x by
    less than one float32 ulp). The exp and log1p at the policy's `transcendental_accuracy`."""
    x = cast(logits, policy.router_softmax_dtype)
    softplus = jnp.maximum(x, 0) + jnp.log1p(precision.exp(-jnp.abs(x), policy))
    return jnp.sqrt(softplus)


def _biased(y: jax.Array, bias: jax.Array | None, policy: NumericPolicy) -> jax.Array:
    """y + bias (a row's expert bias, already in the param dtype) in the compute dtype; y when no bias."""
    return y if bias is None else y + as_compute(bias, policy)


def _expert_product(policy: NumericPolicy):
    """The per-expert product: block-scaled FP8 (`fp8.expert_linear`) when the policy quantises, else plain."""
    return fp8.expert_linear if policy.quantizes_products else expert_matmul


def expert_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               policy: NumericPolicy, biases: tuple | None = None, act: ClampedSwiGLU | None = None) -> jax.Array:
    """SwiGLU experts on per-expert row blocks: x [E, R, H] -> [E, R, H] (compute dtype). `biases` (gpt-oss):
    (gate [E, F], up [E, F], down [E, H]), each added to its product; `act`: the gated activation (`gated`)."""
    product = _expert_product(policy)
    b_gate, b_up, b_down = (None, None, None) if biases is None else (b[:, None] for b in biases)
    hidden = gated(_biased(product(x, w_gate, policy), b_gate, policy),
                   _biased(product(x, w_up, policy), b_up, policy), policy, act)
    return _biased(product(hidden, w_down, policy), b_down, policy)


def dispatch(x: jax.Array, idx: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
             policy: NumericPolicy, *, biases: tuple | None = None,
             act: ClampedSwiGLU | None = None) -> tuple[jax.Array, jax.Array]:
    """Run the selected experts for every token.

    x [N, H], idx [N, k] expert ids. `biases` and `act` as `expert_ffn` takes them. Returns (y [N, k, H] expert
    outputs in slot order, kept [N, k] bool); dropped assignments (capacity dispatch) have y = 0 and kept = False.
    """
    n, k = idx.shape
    num_experts = w_gate.shape[0]
    if policy.dispatch == "dense":
        # the input's gradient sums the experts with the tree whatever `reduce` says: autodiff's reduce over the
        # expert axis was fused by XLA:CPU with the products before it into one YNNPACK kernel (40% of a step)
        y_all = expert_ffn(tree_broadcast(x[None], 0, num_experts), w_gate, w_up, w_down, policy, biases, act)
        y = jnp.take_along_axis(jnp.moveaxis(y_all, 0, 1), idx[..., None], axis=1)
        return y, jnp.ones(idx.shape, bool)
    if policy.dispatch == "gather":
        rows = jnp.broadcast_to(x[:, None], (n, k, x.shape[-1]))
        b_gate, b_up, b_down = (None, None, None) if biases is None else (b[idx] for b in biases)
        hidden = gated(_biased(gathered_matmul(rows, w_gate[idx], policy), b_gate, policy),
                       _biased(gathered_matmul(rows, w_up[idx], policy), b_up, policy), policy, act)
        return _biased(gathered_matmul(hidden, w_down[idx], policy), b_down, policy), jnp.ones(idx.shape, bool)
    if policy.dispatch == "sorted":
        return _dispatch_sorted(x, idx, w_gate, w_up, w_down, policy, biases, act), jnp.ones(idx.shape, bool)
    if policy.dispatch == "bucketed":
        return _dispatch_bucketed(x, idx, w_gate, w_up, w_down, policy, biases, act), jnp.ones(idx.shape, bool)
    return _dispatch_capacity(x, idx, w_gate, w_up, w_down, policy, biases, act)


def _dispatch_sorted(x, idx, w_gate, w_up, w_down, policy, biases=None, act=None):
    n, k = idx.shape
    num_experts = w_gate.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    product = fp8.grouped_linear if policy.quantizes_products else grouped_matmul
    b_gate, b_up, b_down = (None, None, None) if biases is None else (b[flat[order]] for b in biases)
    hidden = gated(_biased(product(rows, w_gate, sizes, policy), b_gate, policy),
                   _biased(product(rows, w_up, sizes, policy), b_up, policy), policy, act)
    y_sorted = _biased(product(hidden, w_down, sizes, policy), b_down, policy)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)


BUCKET_RATIOS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)


def bucket_sizes(tokens: int, k: int, num_experts: int) -> tuple[int, ...]:
    """Row counts the bucketed dispatch compiles per-expert buffers for, ascending: the mean load
    (tokens * k / experts) times `BUCKET_RATIOS`, rounded up, and finally `tokens`, which holds any load (a token
    picks an expert at most once)."""
    mean = tokens * k / num_experts
    sizes = {min(tokens, max(1, math.ceil(mean * r))) for r in BUCKET_RATIOS}
    return tuple(sorted(sizes | {tokens}))


def bucket_index(counts: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """Index of the smallest of `sizes` that holds the busiest expert's rows (counts [E])."""
    return jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < jnp.max(counts)).astype(jnp.int32)


def _buffer_slots(flat: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """For expert ids flat [A]: each assignment's row in its expert's buffer (token order, then slot order) and the
    per-expert counts [E]."""
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    return jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1, jnp.sum(onehot, axis=0)


def _to_buffers(x, k, flat, slot, num_experts, capacity):
    """Per-expert buffers [E, capacity, H]: token i's j-th assignment (row i*k+j of flat/slot) at row slot of
    expert flat; a slot >= capacity is dropped, unused rows are zero."""
    rows = jnp.repeat(x, k, axis=0)
    return jnp.zeros((num_experts, capacity, x.shape[-1]), x.dtype).at[flat, slot].set(rows, mode="drop")


def _dispatch_bucketed(x, idx, w_gate, w_up, w_down, policy, biases=None, act=None):
    """Each expert's rows in a [C, H] buffer, C the smallest bucket size that holds the busiest expert: one
    compiled branch per size (`lax.switch`), so only ~C/N of the dense dispatch's rows are multiplied and no
    assignment is ever dropped (the last size is N).

    The backward is a `lax.switch` too, each branch recomputing its forward (a custom VJP): autodiff of the
    switch instead hands every branch's residuals across it, zero-filled for the branches not taken, which cost
    more than the products in a training step."""
    n, k = idx.shape
    num_experts = w_gate.shape[0]
    flat = idx.reshape(-1)
    slot, counts = _buffer_slots(flat, num_experts)
    sizes = bucket_sizes(n, k, num_experts)
    weights = (w_gate, w_up, w_down) + (() if biases is None else tuple(biases))

    def branch(capacity):
        def run(x, weights, flat, slot):
            buffer = _to_buffers(x, k, flat, slot, num_experts, capacity)
            return expert_ffn(buffer, *weights[:3], policy, weights[3:] or None, act)[flat, slot]
        return run

    branches = [branch(c) for c in sizes]

    @jax.custom_vjp
    def bucketed(x, weights, flat, slot, which):
        return lax.switch(which, branches, x, weights, flat, slot)

    def bwd(inputs, g):
        *operands, flat, slot, which = inputs

        def grads(run):
            return lambda g, *operands: jax.vjp(lambda *ops: run(*ops, flat, slot), *operands)[1](g)

        return (*lax.switch(which, [grads(run) for run in branches], g, *operands), None, None, None)

    bucketed.defvjp(lambda *inputs: (bucketed(*inputs), inputs), bwd)
    which = bucket_index(counts, sizes)
    return bucketed(x, weights, flat, slot, which).reshape(n, k, -1)


def _dispatch_capacity(x, idx, w_gate, w_up, w_down, policy, biases=None, act=None):
    n, k = idx.shape
    num_experts = w_gate.shape[0]
    capacity = max(1, math.ceil(policy.capacity_factor * n * k / num_experts))
    flat = idx.reshape(-1)  # priority: token order, then slot order
    slot_in_expert, _ = _buffer_slots(flat, num_experts)
    kept = slot_in_expert < capacity
    y_buf = expert_ffn(_to_buffers(x, k, flat, slot_in_expert, num_experts, capacity), w_gate, w_up, w_down, policy,
                       biases, act)
    y = y_buf[flat, jnp.minimum(slot_in_expert, capacity - 1)]
    y = jnp.where(kept[:, None], y, jnp.zeros_like(y))
    return y.reshape(n, k, -1), kept.reshape(n, k)


def _gate(y: jax.Array, w: jax.Array, policy: NumericPolicy) -> jax.Array:
    """y [N, k, H] * w [N, k] (broadcast over H). Its gradient for w sums over H; with `reduction=tree` that sum
    is the policy's tree (XLA's own reduce orders the adds by how it fused the backward, which differs between
    programs), so the router's gradient is as reproducible as the forward."""
    if not policy.tree_reduction:
        return y * w[..., None]

    @jax.custom_vjp
    def gate(y, w):
        return y * w[..., None]

    def fwd(y, w):
        return gate(y, w), (y, w)

    def bwd(res, g):
        y, w = res
        g = g.astype(y.dtype)
        return g * w[..., None], reduce_sum(g * y, policy, axis=-1).astype(w.dtype)

    gate.defvjp(fwd, bwd)
    return gate(y, w)


# The three ways a MoE block sums its k weighted expert outputs that the seed traced on Qwen3.5-MoE (values of
# combine_weight_dtype, combine_acc_dtype, combine_order; jaxalign.align.aggregation measures them):
AGGREGATION_PATHS = {
    # transformers' eager experts loop: bf16 gate weights, each expert's output weighted in bf16 and index_add_-ed
    # into a bf16 buffer, one expert at a time
    "eager": (("combine_weight_dtype", "bf16"), ("combine_acc_dtype", "bf16"), ("combine_order", "expert")),
    # transformers' grouped_mm path: the same bf16 products summed over the top-k slots in float32, cast once
    "grouped": (("combine_weight_dtype", "bf16"), ("combine_acc_dtype", "f32"), ("combine_order", "slot")),
    # float32 gate weights and products, summed in float32, cast once
    "f32": (("combine_weight_dtype", "f32"), ("combine_acc_dtype", "f32"), ("combine_order", "slot")),
}


def with_aggregation(policy: NumericPolicy, path: str) -> NumericPolicy:
    """`policy` with its combine fields set to the aggregation path `path` (a key of AGGREGATION_PATHS)."""
    if path not in AGGREGATION_PATHS:
        raise ValueError(f"aggregation path {path!r}; allowed: {', '.join(AGGREGATION_PATHS)}")
    return policy.replace(**dict(AGGREGATION_PATHS[path]))


def combine(y: jax.Array, idx: jax.Array, weights: jax.Array, num_experts: int,
            policy: NumericPolicy) -> jax.Array:
    """Weighted sum of the k expert outputs per token: y [N, k, H], idx/weights [N, k] -> [N, H] (compute dtype).

    Each output is multiplied by its gate weight in `combine_weight_dtype` (as transformers multiplies in the
    model dtype); the products are summed in `combine_acc_dtype`, in the order `combine_order` names.
    """
    acc = dtype(policy.combine_acc_dtype)
    wdt = policy.combine_weight_dtype
    products = cast(_gate(cast(y, wdt), cast(weights, wdt), policy), policy.combine_acc_dtype)  # [N, k, H]
    if policy.combine_order == "slot":
        out = products[:, 0]
        for j in range(1, products.shape[1]):
            out = out + products[:, j]
    elif policy.combine_order == "expert":
        def add_expert(e, out):
            contribution = jnp.sum(jnp.where((idx == e)[..., None], products, jnp.zeros_like(products)), axis=1)
            return out + contribution  # exactly one slot (or none) is non-zero
        out = lax.fori_loop(0, num_experts, add_expert, jnp.zeros(products[:, 0].shape, acc))
    else:  # dense: all experts, zeros for the unselected, one reduction
        dense = jnp.zeros((y.shape[0], num_experts, y.shape[-1]), acc)
        dense = dense.at[jnp.arange(y.shape[0])[:, None], idx].add(products)
        out = reduce_sum(jnp.moveaxis(dense, 1, -1), policy, axis=-1)
    return cast(out, policy.compute_dtype)
