"""Logical axes -> mesh axes: the one table that says how parameters, activations and the KV cache are split.

Every parameter carries logical axis names (`layers.param`); activations are tagged with `constrain` at layer
boundaries. `RULES` maps each logical name to mesh axes among `MESH_AXES`:

- `data`   : batch rows (pure data parallelism; parameters replicated)
- `fsdp`   : batch rows too, and the parameters' `embed` axis (ZeRO-3 style: weights gathered per layer)
- `expert` : the expert axis of the routed experts' weights and of their activations (expert parallelism)
- `tensor` : attention heads, MLP hidden, expert hidden and vocabulary (Megatron-style tensor parallelism)

A mesh axis of size 1 is ignored; a mesh axis that does not divide a dimension leaves it unsplit (tiny test
models have dimensions that 8 does not always divide) -- `spec_for` is the single place that decides.

`make_mesh("data=2,expert=2,tensor=2")` builds a mesh with all four axes (unnamed ones have size 1), with
`AxisType.Auto` axes: XLA's SPMD partitioner places what the constraints leave open. Run jitted code under
`jax.set_mesh(mesh)` so `constrain` sees the mesh; without a mesh every function here is a no-op.
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxalign.numerics.collectives import mesh_active

MESH_AXES = ("data", "fsdp", "expert", "tensor")
_BATCH = ("data", "fsdp")

RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "expert": ("expert",),
    "expert_mlp": ("tensor",),
    "expert_scores": (),
    "head_dim": (),
    "norm": (),
    "unsharded": (),
    "lora_rank": (),
    # activations
    "batch": _BATCH,
    "seq": (),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_vocab": ("tensor",),
    "act_expert": ("expert",),
    # KV cache: keys [batch, kv_heads, head_dim, slots], values [batch, kv_heads, slots, head_dim] (model/attention.py)
    "cache_batch": _BATCH,
    "cache_seq": (),
    "cache_kv_heads": ("tensor",),
}


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """`"data=2,tensor=4"` -> {"data": 2, "fsdp": 1, "expert": 1, "tensor": 4}. `""`/`"single"` -> all ones."""
    sizes = {axis: 1 for axis in MESH_AXES}
    if not isinstance(spec, str):
        raise ValueError(f"mesh spec must be a string like 'data=2,tensor=4', got {spec!r}")
    if spec.strip() in ("", "single"):
        return sizes
    seen = set()
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES:
            raise ValueError(f"mesh spec item {part.strip()!r} in {spec!r}: expected AXIS=SIZE with AXIS one of "
                             f"{', '.join(MESH_AXES)}")
        if name in seen:
            raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
        seen.add(name)
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh axis {name} = {value.strip()!r} in {spec!r}; allowed: a positive int")
        sizes[name] = size
    return sizes


def make_mesh(spec: str, devices=None) -> Mesh:
    """A 4-axis mesh (`data`, `fsdp`, `expert`, `tensor`) from a spec like `"data=2,expert=2,tensor=2"`.

    Uses the first prod(sizes) of `devices` (default `jax.devices()`, every process's devices); with several
    processes the mesh must span all of them."""
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"mesh {spec!r} needs {need} devices but {len(devices)} are available; on CPU fake more "
                         f"with --host-devices N (XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    if jax.process_count() > 1 and need != len(devices):
        raise ValueError(f"with {jax.process_count()} processes the mesh must use all {len(devices)} devices; "
                         f"{spec!r} uses {need}")
    grid = np.array(devices[:need], dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_description(mesh: Mesh | None) -> str:
    """`"data=2,tensor=4"` (axes of size > 1), or `"single"`."""
    if mesh is None:
        return "single"
    parts = [f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1]
    return ",".join(parts) or "single"


def spec_for(logical_axes: tuple[str | None, ...], mesh_shape: dict[str, int],
             shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """The PartitionSpec RULES give to an array with these logical axes on a mesh of `mesh_shape`.

    A mesh axis is used at most once per array (first logical axis wins), only when its size is > 1 and, when
    `shape` is given, only while the product of the mesh axes used for a dimension divides it."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        if name is None:
            out.append(None)
            continue
        if name not in RULES:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {', '.join(RULES)}")
        chosen, product = [], 1
        for axis in RULES[name]:
            size = mesh_shape.get(axis, 1)
            if size == 1 or axis in used:
                continue
            if shape is not None and shape[i] % (product * size):
                continue
            chosen.append(axis)
            product *= size
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*out)


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint on an activation from its logical axes (no-op without an active mesh)."""
    if not mesh_active():
        return x
    mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, spec_for(logical_axes, dict(mesh.shape), x.shape))


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)`, or a no-op context for mesh None (one device)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def logical_axes_of(variable: nnx.Variable) -> tuple[str, ...]:
    """The logical axis names a parameter was created with."""
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
        raise ValueError(f"parameter of shape {variable[...].shape} has no logical_axes metadata; create it with "
                         f"jaxalign.model.layers.param")
    return tuple(axes)


def state_shardings(state: nnx.State, mesh: Mesh):
    """A pytree like `state` (an nnx State of Params) holding each parameter's NamedSharding under RULES."""
    mesh_shape = dict(mesh.shape)

    def one(variable):
        value = variable[...]
        return variable.replace(NamedSharding(mesh, spec_for(logical_axes_of(variable), mesh_shape, value.shape)))
    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_state(state: nnx.State, mesh: Mesh | None) -> nnx.State:
    """`state` with every parameter placed on `mesh` as RULES say (a copy). With mesh None, parameters that
    are spread over several devices are gathered onto this process's first device (a one-device program must
    not inherit another program's placement); others are left as they are."""
    if mesh is None:
        device = jax.local_devices()[0]
        return jax.tree.map(lambda x: x if len(getattr(x, "devices", lambda: ())()) <= 1
                            else jax.device_put(to_host(x), device), state)
    shardings = state_shardings(state, mesh)
    return jax.tree.map(lambda x, s: put_global(x, s), state, shardings)


def on_first_device(tree):
    """Every array of `tree` committed to this process's first local device.

    jit specialises a function on whether each input is committed to a device. Fresh arrays (new parameters,
    optax's step counter) are not; a loaded checkpoint's are, and so are a jitted step's outputs whenever any of
    its inputs was. A loop starting from such a mix and feeding each step's outputs back in compiled its step
    twice, and the programs reading those outputs (scoring, the engine) twice too. Placing the loop's starting
    state here first makes every call after the first reuse its program."""
    device = jax.local_devices()[0]
    return jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, tree)


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """device_put that also works when the mesh spans several processes (each puts only its own shards of a
    value every process holds: process-local data)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x) if getattr(x, "is_fully_addressable", True) else None
    if host is None:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_batch(x, mesh: Mesh | None, logical_axes: tuple[str | None, ...] | None = None):
    """A host array (identical on every process) placed on `mesh`, rows split over the batch axes."""
    if mesh is None or x is None:
        return x
    x = np.asarray(x)
    axes = logical_axes if logical_axes is not None else ("batch",) + (None,) * (x.ndim - 1)
    return put_global(x, NamedSharding(mesh, spec_for(axes, dict(mesh.shape), x.shape)))


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) array as a full numpy array on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
