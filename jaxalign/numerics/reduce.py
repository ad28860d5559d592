"""Reductions, softmaxes and norms under a NumericPolicy.

`reduction="tree"` sums with a fixed halving tree: the axis is zero-padded to a power of two and folded in half
(`x[:n/2] + x[n/2:]`) until one element is left. Every add is an elementwise IEEE add, so the result for one row
does not depend on how many rows are computed beside it, and zero padding to any larger power of two leaves the
bits unchanged (the first folds add exact zeros). That is what makes prefill, decode and the trainer's full
forward agree bitwise when they reduce over different cache lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxalign.numerics import precision
from jaxalign.numerics.collectives import local_reduce, with_parameter
from jaxalign.numerics.dtypes import as_compute, as_param, cast, dtype_name
from jaxalign.numerics.policy import NumericPolicy


def pad_to_tree_width(x: jax.Array, axis: int) -> jax.Array:
    """x zero-padded along `axis` to the halving tree's width (the next power of two)."""
    n = x.shape[axis]
    width = 1 << max(0, (n - 1).bit_length())
    if width == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - n)
    return jnp.pad(x, pad)


def _halving_tree(x: jax.Array, axis: int, keepdims: bool) -> jax.Array:
    x = pad_to_tree_width(x, axis)
    width = x.shape[axis]
    while width > 1:
        width //= 2
        x = jax.lax.slice_in_dim(x, 0, width, axis=axis) + jax.lax.slice_in_dim(x, width, 2 * width, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` with a fixed halving tree (batch- and padding-invariant; see module docstring).

    Its gradient is the cotangent broadcast back over `axis` (the derivative of a sum, no arithmetic). Autodiff
    of the tree instead transposed every fold into two pads and an add -- a tenth of an aligned gradient's
    kernels, most of its compile time's growth -- and turned a -0.0 cotangent into +0.0 (`-0 + 0`)."""
    axis = axis % x.ndim
    shape = x.shape

    @jax.custom_vjp
    def summed(v):
        return _halving_tree(v, axis, keepdims)

    def backward(_, g):
        return (jnp.broadcast_to(g if keepdims else jnp.expand_dims(g, axis), shape),)

    summed.defvjp(lambda v: (summed(v), None), backward)
    return summed(x)


def reduce_sum(x: jax.Array, policy: NumericPolicy, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over one axis in x's dtype, in the order the policy's `reduction` names (and, on a mesh, where its
    `cross_device` field says)."""
    x = local_reduce(x, policy, (axis,))
    if policy.tree_reduction:
        return tree_sum(x, axis, keepdims)
    return jnp.sum(x, axis=axis, keepdims=keepdims, dtype=x.dtype)


def tree_broadcast(x: jax.Array, axis: int, size: int) -> jax.Array:
    """x's size-1 `axis` broadcast to `size`; its gradient sums over that axis with the halving tree (elementwise
    adds in a fixed order, where autodiff would emit an XLA reduce)."""
    shape = list(x.shape)
    shape[axis] = size

    @jax.custom_vjp
    def broadcast(v):
        return jnp.broadcast_to(v, shape)

    broadcast.defvjp(lambda v: (broadcast(v), None), lambda _, g: (tree_sum(g, axis, keepdims=True),))
    return broadcast(x)


def expand(x: jax.Array, axis: int, size: int, policy: NumericPolicy) -> jax.Array:
    """x's size-1 `axis` broadcast to `size` (a keepdims sum or norm about to meet the full array).

    The gradient of a broadcast is a sum over the broadcast axis. With `reduction=tree` that sum is the tree
    too: XLA's own reduce orders its adds by how the backward program was fused, so without this the same
    gradient got different bits in differently compiled programs (e.g. a mesh's)."""
    if not policy.tree_reduction:
        shape = list(x.shape)
        shape[axis] = size
        return jnp.broadcast_to(x, shape)
    return tree_broadcast(x, axis, size)


def divide_by(x: jax.Array, denominator: jax.Array, axis: int, policy: NumericPolicy) -> jax.Array:
    """x / denominator, the denominator size 1 along `axis` (a keepdims sum, e.g. a softmax's) and broadcast
    back over it with `expand`.

    Under `reduction=tree`: x times the broadcast reciprocal `1 / denominator`, both in float32, the product
    rounded once to x's dtype (for float32 x: two roundings, as stated).
    XLA:CPU's compiler rewrites a division by a broadcast into exactly that, but only in some programs
    (it kept the division where the broadcast had other users, as in a gradient program), so the same attention
    weights differed by one float32 ulp between `token_logprobs`' program and the RL update's -- and where the
    bf16 rounding after it sat on a tie, by one bf16 ulp, 0.013 in a logprob (found by an RL run on a mesh
    under --xla_cpu_max_isa=AVX2; weights-dependent, any ISA). XLA's rewrites go from a division to a product,
    never back, so every program rounds the same way. Under `reduction=xla` XLA decides."""
    size = x.shape[axis]
    if not policy.tree_reduction:
        return x / expand(denominator, axis, size, policy)
    inverse = 1.0 / denominator.astype(jnp.float32)
    return cast(x.astype(jnp.float32) * expand(inverse, axis, size, policy), dtype_name(x.dtype))


def softmax(x: jax.Array, policy: NumericPolicy, dtype_name: str, axis: int = -1) -> jax.Array:
    """Softmax computed in `dtype_name`; masked entries should be -inf. Normalised by `divide_by`."""
    x = cast(x, dtype_name)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = precision.exp(shifted, policy)
    return divide_by(e, reduce_sum(e, policy, axis=axis, keepdims=True), axis, policy)


def log_softmax(x: jax.Array, policy: NumericPolicy, dtype_name: str = "f32", axis: int = -1) -> jax.Array:
    """log-softmax computed in `dtype_name` (f32 by default, for logprobs)."""
    x = cast(x, dtype_name)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    log_total = precision.log(reduce_sum(precision.exp(shifted, policy), policy, axis=axis, keepdims=True), policy)
    return shifted - expand(log_total, axis, x.shape[axis], policy)


def rms_norm(x: jax.Array, weight: jax.Array, policy: NumericPolicy, eps: float) -> jax.Array:
    """RMSNorm over the last axis: normalised in `norm_dtype`, cast to the compute dtype, then times the weight
    (in the compute dtype, as transformers does)."""
    xn = cast(x, policy.norm_dtype)
    # inside one fusion LLVM may contract a*a + b*b into an FMA (one rounding instead of two) depending on how
    # the program was fused -- a sharded program fuses differently
    squares = uncontracted(xn * xn, policy)
    mean_sq = reduce_sum(squares, policy, axis=-1, keepdims=True) / xn.shape[-1]
    normed = xn * expand(jax.lax.rsqrt(mean_sq + jnp.asarray(eps, xn.dtype)), -1, xn.shape[-1], policy)
    scale = lambda n, w: as_compute(n, policy) * as_compute(as_param(w, policy), policy)  # noqa: E731
    return with_parameter(scale, policy)(normed, weight)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, policy: NumericPolicy, eps: float) -> jax.Array:
    """LayerNorm over the last axis (the DSA indexer's key norm): mean and variance in `norm_dtype`, then
    times the weight plus the bias in the compute dtype."""
    xn = cast(x, policy.norm_dtype)
    width = xn.shape[-1]
    centred = xn - expand(reduce_sum(xn, policy, axis=-1, keepdims=True) / width, -1, width, policy)
    squares = centred * centred
    if policy.tree_reduction:
        squares = jax.lax.optimization_barrier(squares)  # no a*a + b*b contracted into an FMA (see rms_norm)
    var = reduce_sum(squares, policy, axis=-1, keepdims=True) / width
    normed = centred * expand(jax.lax.rsqrt(var + jnp.asarray(eps, xn.dtype)), -1, width, policy)
    affine = lambda n, w, b: (as_compute(n, policy) * as_compute(as_param(w, policy), policy)  # noqa: E731
                              + as_compute(as_param(b, policy), policy))
    return with_parameter(affine, policy)(normed, weight, bias)


def global_norm(tree, policy: NumericPolicy) -> jax.Array:
    """The L2 norm of every array in a pytree together (float32), e.g. for gradient clipping.

    With `reduction="tree"`: each array's squares are rounded on their own (`uncontracted`) and tree-summed,
    then the per-array sums are tree-summed in the pytree's leaf order -- a fixed order, so a sharded trainer's
    norm (and the clipping scale it sets) has one device's bits. XLA's reduce ordered these adds by how the update program was fused."""
    leaves = [jnp.asarray(x, jnp.float32).reshape(-1) for x in jax.tree.leaves(tree)]
    if not policy.tree_reduction:
        return jnp.sqrt(sum(jnp.sum(x * x) for x in leaves))
    squares = [uncontracted(x * x, policy) for x in leaves]  # no a*a + b*b contracted into an FMA
    return jnp.sqrt(tree_sum(jnp.stack([tree_sum(x) for x in squares])))


def total(x: jax.Array, policy: NumericPolicy, mask: jax.Array | None = None) -> jax.Array:
    """The sum of every element of x (those where `mask`, a 0/1 array of x's shape, is non-zero), in x's dtype.

    With `reduction="tree"` the elements are summed row-major with the halving tree: a fixed order, so a loss
    or a metric has the same bits in every program that computes it (one device, a mesh's replicated copy,
    each of several processes). XLA's reduce orders its adds by how the program around it was fused and by the
    vector width of the ISA it targets: `-jnp.mean(logprobs)` gave a mesh's loss one float32 ulp away from one
    device's under AVX2. Masked-out elements are selected away (no product), and the summands are kept from
    the tree's first adds (`uncontracted`): a product computed just before would otherwise be contracted with the
    tree's first adds into FMAs in some programs and not in others. Under `cross_device=ordered` on a mesh the
    array is gathered first."""
    if mask is not None:
        x = jnp.where(jnp.asarray(mask) != 0, x, jnp.zeros((), x.dtype))
    if not policy.tree_reduction:
        return jnp.sum(x, dtype=x.dtype)
    x = local_reduce(uncontracted(x, policy), policy, tuple(range(x.ndim)))
    return tree_sum(x.reshape(-1))


def mean(x: jax.Array, policy: NumericPolicy, mask: jax.Array | None = None) -> jax.Array:
    """`total(x, policy, mask)` divided by the number of elements summed (at least 1), e.g. a token-mean loss."""
    if mask is None:
        return total(x, policy) / jnp.asarray(max(1, x.size), x.dtype)
    count = total(jnp.asarray(mask != 0, x.dtype), policy)  # small integers: exact in any order
    return total(x, policy, mask) / jnp.maximum(count, jnp.ones((), x.dtype))


def uncontracted(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """x (a product about to meet an add) kept from being contracted with that add into a fused multiply-add,
    under `reduction="tree"`; identity under `reduction="xla"`.

    XLA:CPU lets LLVM contract `a * b + c` into one FMA (one rounding instead of two) whenever the ISA has FMA
    (AVX2 and later; not AVX or SSE4.2) and the multiply and the add land in one fusion -- which depends on how
    the whole program was fused, so the same expression rounded differently in a one-device program and a
    mesh's. Neither `lax.optimization_barrier` (XLA:CPU expands it before fusion), `reduce_precision` nor a
    bitcast round trip stops it: they are simplified away. `where(x == x, x, nan)` is the same value (NaN stays
    NaN) but puts a select between the multiply and the add, which LLVM does not contract across: products are
    rounded on their own in every program and under every ISA (docs/policies.md, "FMA contraction";
    tests/test_optimizer.py checks it)."""
    if not policy.tree_reduction:
        return x
    return jnp.where(x == x, x, jnp.asarray(jnp.nan, x.dtype))
