"""The precision every matrix product states, decided by the policy, and the backends that can run it.

A dot_general whose `precision` is left at DEFAULT is computed however the backend likes: one bf16 pass on a TPU,
TF32 on an Ampere/Hopper GPU, full float32 on XLA:CPU. So every product jaxalign compiles goes through `dot`,
`einsum` or `ragged_dot` here, which pass the policy's choice explicitly:

- `matmul_acc` f32/bf16/f16: `lax.Precision.HIGHEST` (full float32 products of f32 operands) and a float32
  result type (low-precision operands accumulate in f32; the bf16/f16 accumulators are emulated by rounding
  f32 partial sums, see `jaxalign.numerics.matmul`).
- `matmul_acc` a `lax.DotAlgorithmPreset` name: that algorithm (e.g. `BF16_BF16_F32`, a TPU's DEFAULT for
  f32 operands; `TF32_TF32_F32`, a GPU's).
- `matmul_bwd`: the products of the gradient. `same` keeps the forward's choice (autodiff copies a product's
  precision into its transposes); `f32` or a preset name gives the gradient its own, through a custom VJP.

XLA:CPU ignores the algorithm (JAX converts no f32 operand for it), so on the CPU the presets change the
program, not the numbers; JAX refuses TF32 and a few others on the CPU. `check_backend` says so before a
program is built, and also refuses float16 (an `f16` field, or an F16 algorithm) where XLA:CPU cannot compile
it: a target without F16C, e.g. `XLA_FLAGS=--xla_cpu_max_isa=SSE4_2` (`platforms.float16_error`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxalign.numerics.platforms import float16_error
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.policy_values import DotAlgorithm, DType

# The presets JAX lets XLA:CPU lower (jax/_src/lax/lax.py `_handle_dot_precision`, JAX 0.10.2); every other
# backend receives the algorithm and checks it itself when compiling.
CPU_DOT_ALGORITHMS = ("DEFAULT", "F16_F16_F16", "F32_F32_F32", "F64_F64_F64", "BF16_BF16_F32",
                      "BF16_BF16_F32_X3", "BF16_BF16_F32_X6")
_ACCURACY = {"default": None, "highest": lax.AccuracyMode.HIGHEST}

Precision = lax.Precision | lax.DotAlgorithmPreset


def _named(value: DType | DotAlgorithm) -> Precision:
    if isinstance(value, DotAlgorithm):
        return value.preset
    return lax.Precision.HIGHEST  # a dtype: full f32 products (a bf16/f16 accumulator is emulated in matmul.py)


def dot_precision(policy: NumericPolicy, *, backward: bool = False) -> Precision:
    """The `precision=` every product of the policy passes (the gradient's with `backward=True`)."""
    check_backend(policy)
    if backward and policy.matmul_bwd != "same":
        return _named(policy.matmul_bwd)
    return _named(policy.matmul_acc)


def accuracy(policy: NumericPolicy) -> lax.AccuracyMode | None:
    """The `accuracy=` the policy asks of exp and log in softmaxes and log-softmax, and of the sigmoid in SiLU,
    sigmoid routers and gates (None: the backend's)."""
    return _ACCURACY[policy.transcendental_accuracy]


def exp(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """exp with the policy's requested accuracy."""
    return lax.exp(x, accuracy=accuracy(policy))


def log(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """log with the policy's requested accuracy."""
    return lax.log(x, accuracy=accuracy(policy))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _logistic(x: jax.Array, accuracy: lax.AccuracyMode | None) -> jax.Array:
    # lax.logistic's own lowering (JAX 0.10.2 `logistic_impl`), with the accuracy passed on to its exp
    one = jnp.asarray(1, x.dtype)
    return lax.div(one, lax.add(one, lax.exp(lax.neg(x), accuracy=accuracy)))


@_logistic.defjvp
def _logistic_jvp(accuracy, primals, tangents):
    (x,), (g,) = primals, tangents
    ans = _logistic(x, accuracy)
    return ans, lax.mul(g, lax.mul(ans, lax.sub(jnp.asarray(1, ans.dtype), ans)))  # lax.logistic's JVP rule


def logistic(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """sigmoid 1 / (1 + exp(-x)) with the policy's requested accuracy on the exp. `lax.logistic` accepts an
    `accuracy=` in JAX 0.10.2 but drops it when lowering (`logistic_impl`: `del accuracy`), so this is its
    lowering and its JVP (ans * (1 - ans)) written out: with the default accuracy the program is lax.logistic's,
    op for op."""
    return _logistic(x, accuracy(policy))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _own_backward(product: Callable, forward: Precision, backward: Precision, *operands):
    return product(forward, *operands)


def _own_backward_fwd(product, forward, backward, *operands):
    return product(forward, *operands), operands


def _own_backward_bwd(product, forward, backward, operands, g):
    # the same product at the backward precision: its transposes (autodiff's own) carry that precision
    _, vjp = jax.vjp(lambda *ops: product(backward, *ops), *operands)
    return vjp(g)


_own_backward.defvjp(_own_backward_fwd, _own_backward_bwd)


def _explicit(product: Callable, policy: NumericPolicy, *operands) -> jax.Array:
    forward, backward = dot_precision(policy), dot_precision(policy, backward=True)
    if forward == backward:
        return product(forward, *operands)
    return _own_backward(product, forward, backward, *operands)


def _dot(precision, a, b):
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def dot(a: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """a [..., K] @ b [K, N] at the policy's precision, float32 result."""
    return _explicit(_dot, policy, a, b)


@functools.lru_cache(maxsize=None)
def _einsum_of(spec: str) -> Callable:
    return lambda precision, a, b: jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def einsum(spec: str, a: jax.Array, b: jax.Array, policy: NumericPolicy, *, backward: bool = False) -> jax.Array:
    """A two-operand einsum at the policy's precision, float32 result. `backward=True`: a product that is itself
    part of a hand-written gradient (it takes the backward precision and is not differentiated again)."""
    if backward:
        return _einsum_of(spec)(dot_precision(policy, backward=True), a, b)
    return _explicit(_einsum_of(spec), policy, a, b)


def _ragged(precision, x, w, group_sizes):
    return lax.ragged_dot(x, w, group_sizes, precision=precision, preferred_element_type=jnp.float32)


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, policy: NumericPolicy) -> jax.Array:
    """`lax.ragged_dot` (rows sorted by group) at the policy's precision, float32 result."""
    return _explicit(_ragged, policy, x, w, group_sizes)


def backward_dot(a: jax.Array, b: jax.Array, policy: NumericPolicy) -> jax.Array:
    """a @ b inside a hand-written gradient: the backward precision, float32 result."""
    return _dot(dot_precision(policy, backward=True), a, b)


def runs_on(policy: NumericPolicy, backend: str | None = None) -> bool:
    """Whether the backend can run every product the policy asks for (see `check_backend`)."""
    try:
        check_backend(policy, backend)
    except ValueError:
        return False
    return True


def float16_fields(policy: NumericPolicy) -> list[str]:
    """The policy's fields that compute in float16: an `f16` dtype, or a dot algorithm with F16 operands."""
    values = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    return [name for name, value in values.items()
            if value == DType.f16 or (isinstance(value, DotAlgorithm) and value.name.startswith("F16"))]


def check_backend(policy: NumericPolicy, backend: str | None = None, *, label: str = "policy") -> None:
    """Raise ValueError, naming the field, its value, the backend and what it allows, when `policy` asks for a
    dot algorithm the backend cannot run, or float16 where XLA:CPU cannot compile it. Cheap (the float16 probe
    compiles once per process): call it before anything long starts."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return  # GPU/TPU compilers check the algorithm against the device themselves
    f16_fields = float16_fields(policy)
    why = float16_error(backend) if f16_fields else None
    if why:
        flags = os.environ.get("XLA_FLAGS", "")
        raise ValueError(f"{label}: {', '.join(f'NumericPolicy.{f} = {getattr(policy, f)!r}' for f in f16_fields)} "
                         f"needs float16, which XLA:CPU cannot compile for this target (no F16C"
                         f"{'; XLA_FLAGS=' + flags if flags else ''}; JAX {jax.__version__}: "
                         f"{why}); allowed here: f32, bf16")
    for field, plain in (("matmul_acc", ("f32", "bf16", "f16")), ("matmul_bwd", ("same", "f32"))):
        value = getattr(policy, field)
        if not isinstance(value, DotAlgorithm) or value.name in CPU_DOT_ALGORITHMS:
            continue
        raise ValueError(f"{label}: NumericPolicy.{field} = {value!r} names a dot algorithm the {backend} backend "
                         f"cannot run (JAX {jax.__version__}); allowed on {backend}: "
                         f"{', '.join(plain + CPU_DOT_ALGORITHMS)}")
