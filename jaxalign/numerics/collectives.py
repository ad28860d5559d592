"""Sums across devices under a NumericPolicy (`cross_device` = xla | ordered).

On a mesh, XLA's SPMD partitioner turns a sum over a sharded axis into per-device partial sums followed by an
all-reduce. The order of those additions depends on the mesh shape (and on the collective's algorithm), so the
bits of e.g. a tensor-parallel `o_proj` or a sharded vocabulary's log-sum-exp change with the mesh.

`ordered` removes every such sum: before an op reduces over an axis, that axis is gathered (a sharding
constraint with the axis unsharded, the others left to the partitioner), so each sum runs whole on one device,
in exactly the order the single-device program uses. Non-reduced axes (batch rows, heads, experts, output
columns) stay split, so the work of those axes is still divided. The gradient of a matmul is treated the same
way (`ordered_vjp`): its weight gradient sums over batch rows, so rows are gathered for it.

This is the reference mode: bitwise equal to one device for any mesh, paid for with all-gathers where `xla`
would all-reduce. Without an active mesh (`jax.set_mesh`) every function here is the identity.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec

from jaxalign.numerics.policy import NumericPolicy


def mesh_active() -> bool:
    """True inside `jax.set_mesh(mesh)` with a mesh of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def gather_axes(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """x with `axes` unsharded (all-gathered if they were split); other axes stay where the partitioner wants."""
    if not mesh_active():
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    for axis in axes:
        spec[axis % x.ndim] = None
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def replicate(x):
    """Every leaf of `x` fully replicated on the active mesh (identity without one)."""
    if not mesh_active():
        return x
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, PartitionSpec()), x)


def local_reduce(x: jax.Array, policy: NumericPolicy, axes: tuple[int, ...]) -> jax.Array:
    """Under `cross_device=ordered`, make the axes about to be reduced device-local; otherwise x unchanged."""
    if policy.cross_device != "ordered":
        return x
    return gather_axes(x, axes)


def ordered_vjp(fn: Callable[..., jax.Array], forward_gather: tuple[tuple[int, ...], ...] = ()):
    """Wrap fn(*args) so that on a mesh none of its sums cross devices, forward or backward.

    Forward: fn with the axes `forward_gather[i]` of argument i gathered (the axes fn sums over; none for
    arguments past the end of `forward_gather`). Backward: the
    arguments and the cotangent are replicated and the single-device VJP of fn runs on them, so the gradients
    (a weight gradient sums over every batch row) have the bits of the one-device program. Without a mesh this
    is fn with its ordinary gradient.
    """
    @jax.custom_vjp
    def wrapped(*args):
        gathers = tuple(forward_gather) + ((),) * (len(args) - len(forward_gather))
        return fn(*(gather_axes(a, axes) if axes else a for a, axes in zip(args, gathers)))

    def fwd(*args):
        return wrapped(*args), args

    def bwd(args, g):
        _, vjp = jax.vjp(fn, *replicate(args))
        return vjp(replicate(g))

    wrapped.defvjp(fwd, bwd)
    return wrapped


def with_parameter(fn: Callable[..., jax.Array], policy: NumericPolicy):
    """fn(activation, parameter, ...) whose parameter is broadcast over batch rows (a norm scale, a bias, an
    embedding lookup): its gradient sums over rows, so under `ordered` on a mesh it runs on one device."""
    if policy.ordered_cross_device and mesh_active():
        return ordered_vjp(fn)
    return fn
