"""Which entries `torch.topk(x, k)` (largest, on the CPU) keeps when values tie, computed in JAX.

The rule, read from ATen's `topk_impl_loop` (aten/src/ATen/native/TopKImpl.h) and checked against torch 2.13 on
many tied rows (tests/test_dsa.py): each row is a buffer of (value, index) pairs ordered by the comparator
`a before b  <=>  (isnan(a) and not isnan(b)) or a > b` (NaN on top, -0.0 ties 0.0, NaN ties NaN), and
- if k * 64 <= n: `std::partial_sort(first, first + k, last)` (libstdc++: `__heap_select`, then `__sort_heap`);
- else: `std::nth_element(first, first + k - 1, last)` (libstdc++'s introselect: median-of-three pivot into the
  first slot, Hoare's unguarded partition, depth limit 2 * floor(log2 n) and then `__heap_select`, an insertion
  sort of the last <= 3 entries), then `std::sort` of the first k - 1.
The kept set is the first k entries of the buffer. Both algorithms are unstable, so among keys that tie at the
k-th value the kept ones follow no positional rule (neither lower nor higher index first), and they depend on the
row's length: the same visible keys followed by more masked (-inf) keys can keep other tied keys.

`members` reproduces the kept set exactly (not torch's order inside it, which the sorts after the selection only
permute): the introselect's partitions as vectorised steps over all rows at once (each is a few cumulative sums
and a scatter; at most 2 * floor(log2 T) of them), its rare heap fallback and the partial-sort path as libstdc++'s
sequential heap code, run (a `lax.cond`) only when some row needs them. It is an emulation for parity with
transformers: each use adds about a second of XLA:CPU compile time, and the heap code's O(T log k) sequential steps
when it runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _before(a: jax.Array, b: jax.Array) -> jax.Array:
    """torch's comparator for `largest=True`: a sorts before b (NaN on top)."""
    return (jnp.isnan(a) & ~jnp.isnan(b)) | (a > b)


def _log2(n: jax.Array) -> jax.Array:
    """floor(log2 n) for n >= 1 (libstdc++'s `__lg`)."""
    return 31 - lax.clz(n.astype(jnp.int32))


class _Rows:
    """A batch of buffers: `perm` [R, T] holds slots of x [R, T] (the buffer's entry i is (x[perm[i]], perm[i]))."""

    def __init__(self, x: jax.Array):
        self.x = x
        self.rows = jnp.arange(x.shape[0])

    def value(self, perm: jax.Array, i: jax.Array) -> jax.Array:
        """The value at buffer position i [R] of each row."""
        return self.x[self.rows, perm[self.rows, jnp.clip(i, 0, perm.shape[1] - 1)]]

    def slot(self, perm: jax.Array, i: jax.Array) -> jax.Array:
        """The slot at buffer position i [R] of each row."""
        return perm[self.rows, jnp.clip(i, 0, perm.shape[1] - 1)]

    def put(self, perm: jax.Array, i: jax.Array, slot: jax.Array, where: jax.Array) -> jax.Array:
        """perm[i] = slot in the rows `where` says."""
        i = jnp.where(where, i, perm.shape[1])  # out of range: dropped
        return perm.at[self.rows, i].set(slot, mode="drop")

    def swap(self, perm: jax.Array, i: jax.Array, j: jax.Array, where: jax.Array) -> jax.Array:
        """`std::iter_swap` of buffer positions i and j in the rows `where` says."""
        si, sj = self.slot(perm, i), self.slot(perm, j)
        return self.put(self.put(perm, i, sj, where), j, si, where)


def _partition_pivot(r: _Rows, perm, first, last, active):
    """libstdc++'s `__unguarded_partition_pivot(first, last)` in the `active` rows: the median of entries
    first + 1, mid, last - 1 moved to `first`, then Hoare's partition of [first + 1, last) around it. Returns
    (perm, cut).

    The scans are not run one entry at a time: the left scan stops at the entries not before the pivot, the right
    scan at the entries the pivot is not before, and until they cross neither meets an entry the other swapped, so
    the m-th swap exchanges the m-th left stop l_m with the m-th right stop from the end r_m, for every m with
    l_m < r_m (a prefix, M swaps), and the cut is min(l_{M+1}, r_M) (r_0 = last)."""
    t = perm.shape[1]
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    va, vb, vc = r.value(perm, a), r.value(perm, b), r.value(perm, c)
    ab, bc, ac = _before(va, vb), _before(vb, vc), _before(va, vc)
    median = jnp.where(ab, jnp.where(bc, b, jnp.where(ac, c, a)),
                       jnp.where(ac, a, jnp.where(bc, c, b)))
    perm = r.swap(perm, first, median, active)
    pivot = r.value(perm, first)[:, None]
    idx = jnp.arange(t)[None, :]
    vals = r.x[r.rows[:, None], perm]
    left = (idx >= first[:, None] + 1) & (idx < last[:, None]) & ~_before(vals, pivot)
    right = (idx >= first[:, None]) & (idx < last[:, None]) & ~_before(pivot, vals)
    l_rank = jnp.cumsum(left, axis=1)  # m for the m-th left stop
    r_rank = jnp.cumsum(right[:, ::-1], axis=1)[:, ::-1]  # m for the m-th right stop from the end
    rows = r.rows[:, None]
    big = jnp.int32(2 * t + 2)
    l_at = jnp.full((perm.shape[0], t + 2), big, jnp.int32).at[
        rows, jnp.where(left, l_rank, t + 1)].set(jnp.broadcast_to(idx, perm.shape).astype(jnp.int32))
    r_at = jnp.full((perm.shape[0], t + 2), -1, jnp.int32).at[
        rows, jnp.where(right, r_rank, t + 1)].set(jnp.broadcast_to(idx, perm.shape).astype(jnp.int32))
    m_idx = jnp.arange(t + 2)[None, :]
    pairs = jnp.sum((l_at < r_at) & (m_idx >= 1) & (m_idx <= t), axis=1).astype(jnp.int32)  # M
    swapped_l = left & (l_rank <= pairs[:, None])
    swapped_r = right & (r_rank <= pairs[:, None])
    partner = jnp.where(swapped_l, jnp.take_along_axis(r_at, jnp.clip(l_rank, 0, t + 1), axis=1),
                        jnp.take_along_axis(l_at, jnp.clip(r_rank, 0, t + 1), axis=1))
    moved = (swapped_l | swapped_r) & active[:, None]
    perm = jnp.where(moved, jnp.take_along_axis(perm, jnp.clip(partner, 0, t - 1), axis=1), perm)
    next_left = jnp.take_along_axis(l_at, (pairs + 1)[:, None], axis=1)[:, 0]
    last_right = jnp.where(pairs > 0, jnp.take_along_axis(r_at, pairs[:, None], axis=1)[:, 0], last)
    return perm, jnp.minimum(next_left, last_right)


def _adjust_heap(r: _Rows, perm, first, hole, length, value_slot, active):
    """libstdc++'s `__adjust_heap(first, hole, length, value)` then `__push_heap`, in the `active` rows (the heap
    is ordered by `_before`: its top is the entry every other one sorts before or ties)."""
    top = hole
    value = r.x[r.rows, value_slot]

    def down_cond(state):
        _, _, second, go = state
        return jnp.any(go & (second < (length - 1) // 2))

    def down(state):
        perm, hole, second, go = state
        go = go & (second < (length - 1) // 2)
        child = 2 * (second + 1)
        child = jnp.where(_before(r.value(perm, first + child), r.value(perm, first + child - 1)), child - 1, child)
        perm = r.put(perm, first + hole, r.slot(perm, first + child), go)
        return perm, jnp.where(go, child, hole), jnp.where(go, child, second), go

    perm, hole, second, _ = lax.while_loop(down_cond, down, (perm, hole, hole, active))
    last_child = active & (length % 2 == 0) & (second == (length - 2) // 2)
    child = 2 * (second + 1)
    perm = r.put(perm, first + hole, r.slot(perm, first + child - 1), last_child)
    hole = jnp.where(last_child, child - 1, hole)

    def up_cond(state):
        _, hole, go = state
        return jnp.any(go & (hole > top))

    def up(state):
        perm, hole, go = state
        parent = jnp.maximum(hole - 1, 0) // 2
        go = go & (hole > top) & _before(r.value(perm, first + parent), value)
        perm = r.put(perm, first + hole, r.slot(perm, first + parent), go)
        return perm, jnp.where(go, parent, hole), go

    perm, hole, _ = lax.while_loop(up_cond, up, (perm, hole, active))
    return r.put(perm, first + hole, value_slot, active)


def _heap_select(r: _Rows, perm, first, middle, last, active):
    """libstdc++'s `__heap_select(first, middle, last)` in the `active` rows: `__make_heap` of [first, middle)
    (an `__adjust_heap` at every parent, the last one first), then every later entry that sorts before the heap's
    top replaces it (`__pop_heap`). One loop over both phases, so the heap code is traced once."""
    t = perm.shape[1]
    length = middle - first
    build_steps = (t + 1) // 2  # make_heap's parents: at most (t - 2) // 2 + 1

    def step(step, perm):
        building = step < build_steps
        parent = (length - 2) // 2 - step
        i = middle + step - build_steps
        build = active & building & (length >= 2) & (parent >= 0)
        pop = active & ~building & (i < last) & _before(r.value(perm, i), r.value(perm, first))
        hole = jnp.where(building, jnp.maximum(parent, 0), 0)
        value_slot = r.slot(perm, jnp.where(building, first + hole, i))
        perm = r.put(perm, i, r.slot(perm, first), pop)
        return _adjust_heap(r, perm, first, hole, length, value_slot, build | pop)

    return lax.fori_loop(0, build_steps + t, step, perm)


def _sort_small(r: _Rows, perm, first, last, active):
    """libstdc++'s `__insertion_sort(first, last)` for last - first <= 3: a stable sort by `_before`."""
    pos = first[:, None] + jnp.arange(3)[None, :]  # [R, 3]
    inside = (pos < last[:, None]) & active[:, None]
    slots = jnp.stack([r.slot(perm, pos[:, j]) for j in range(3)], axis=1)
    vals = r.x[r.rows[:, None], slots]
    ahead = _before(vals[:, None, :], vals[:, :, None]) | (
        ~_before(vals[:, :, None], vals[:, None, :]) & (jnp.arange(3)[None, :] < jnp.arange(3)[:, None])[None])
    rank = jnp.sum(ahead & inside[:, None, :], axis=2)  # [R, 3]: entries of the range placed before entry i
    for j in range(3):
        perm = r.put(perm, first + rank[:, j], slots[:, j], inside[:, j])
    return perm


def members(x: jax.Array, k: jax.Array, n: jax.Array) -> jax.Array:
    """The entries `torch.topk(x[i, :n[i]], k[i])` keeps on the CPU (see the module docstring), as a mask.

    x [R, T] float32 (entries past a row's length n are not part of it), k [R] and n [R] int32 with
    1 <= k <= n <= T. Returns bool [R, T]: the k kept slots of each row."""
    perm, _ = arrangement(x, k, n)
    kept = jnp.arange(x.shape[1])[None, :] < k[:, None]
    return jnp.zeros(x.shape, bool).at[jnp.arange(x.shape[0])[:, None], perm].set(kept)


def arrangement(x: jax.Array, k: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The buffer torch's CPU topk holds after its selection step (before it sorts the first k - 1 entries), as
    slots [R, T] (its first k are the kept entries), and which rows took libstdc++'s heap code [R] bool (the
    partial-sort path, or an introselect that ran out of depth). Arguments as `members`."""
    x = lax.stop_gradient(x.astype(jnp.float32))
    n_rows, t = x.shape
    k, n = k.astype(jnp.int32), n.astype(jnp.int32)
    r = _Rows(x)
    perm = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n_rows, t))
    partial = k * 64 <= n  # std::partial_sort; otherwise std::nth_element
    nth = k - 1
    zero = jnp.zeros_like(n)

    def select_cond(state):
        _, first, last, depth = state
        return jnp.any(~partial & (last - first > 3) & (depth > 0))

    def select(state):
        perm, first, last, depth = state
        active = ~partial & (last - first > 3) & (depth > 0)
        perm, cut = _partition_pivot(r, perm, first, last, active)
        first = jnp.where(active & (cut <= nth), cut, first)
        last = jnp.where(active & (cut > nth), cut, last)
        return perm, first, last, jnp.where(active, depth - 1, depth)

    perm, first, last, _ = lax.while_loop(select_cond, select, (perm, zero, n, 2 * _log2(n)))
    heap = ~partial & (last - first > 3)  # the introselect ran out of depth
    perm = _sort_small(r, perm, first, last, ~partial & ~heap)
    need = heap | partial
    h_first = jnp.where(partial, 0, first)
    h_middle = jnp.where(partial, k, nth + 1)
    h_last = jnp.where(partial, n, last)

    def heap_path(perm):
        perm = _heap_select(r, perm, h_first, h_middle, h_last, need)
        return r.swap(perm, first, nth, heap)  # introselect: the nth entry into its place

    return lax.cond(jnp.any(need), heap_path, lambda p: p, perm), need
