"""The row-tiled kernel's cost in isolation, and a batched alternative: bits and time of one bf16 product.

    python benchmarks/tile_kernel.py [--tile 8] [--k 256] [--n 512] [--tiles 80] [--repeats 20]

Three ways to compute [tiles * tile, K] @ [K, N] (bf16 operands, f32 accumulation): `mapped` (today's
`kernel=tiled:T`: one [tile, K] product per tile in a `lax.map`), `batched` (the tiles as the batch dimension of
one `dot_general`, the weight broadcast to every tile) and `plain` (one dot, not batch-invariant in general).
It reports each one's best time and whether `batched` gives, for every tile count 1..tiles, the same bits as the
same rows at the full tile count and as `mapped`. Run it under `XLA_FLAGS=--xla_cpu_max_isa=AVX2` / `SSE4_2`
for other ISAs. Writes benchmarks/results/tile_kernel.json (the ISA cap is in machine.threads.xla_flags).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import timed, write_json  # noqa: E402,I001


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, default=8)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--tiles", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/tile_kernel.json")
    args = parser.parse_args(argv)
    if min(args.tile, args.k, args.n, args.tiles, args.repeats) < 1:
        parser.error("--tile, --k, --n, --tiles and --repeats must be positive")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from jaxalign import report
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(args.k, args.n)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(args.tiles * args.tile, args.k)), jnp.bfloat16)

    def mapped(tiles, w):
        return lax.map(lambda t: lax.dot(t, w, preferred_element_type=jnp.float32), tiles)

    def batched(tiles, w):
        wb = jnp.broadcast_to(w, (tiles.shape[0],) + w.shape)
        return lax.dot_general(tiles, wb, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)

    kernels = {"mapped": jax.jit(mapped), "batched": jax.jit(batched),
               "plain": jax.jit(lambda rows, w: lax.dot(rows, w, preferred_element_type=jnp.float32))}
    tiled = x.reshape(args.tiles, args.tile, args.k)
    inputs = {"mapped": tiled, "batched": tiled, "plain": x}
    full = np.asarray(kernels["batched"](tiled, w)).reshape(-1, args.n)
    invariant, equals_mapped = True, True
    for count in range(1, args.tiles + 1):
        part = x[: count * args.tile].reshape(count, args.tile, args.k)
        got = np.asarray(kernels["batched"](part, w)).reshape(-1, args.n)
        invariant &= np.array_equal(got, full[: count * args.tile])
        equals_mapped &= np.array_equal(got, np.asarray(kernels["mapped"](part, w)).reshape(-1, args.n))
    rows = []
    for name, fn in kernels.items():
        timed(lambda: fn(inputs[name], w))  # compile
        best = min(timed(lambda: fn(inputs[name], w))[0] for _ in range(args.repeats))
        rows.append({"kernel": name, "best_ms": best * 1e3})
    summary = {"batched_rows_invariant_to_tile_count": bool(invariant), "batched_equals_mapped": bool(equals_mapped),
               "xla_flags": os.environ.get("XLA_FLAGS", "")}
    table = report.table(rows, ["kernel", "best_ms"])
    print(table)
    print(summary)
    write_json(args.out, {"args": vars(args), "rows": rows, "summary": summary, "tables": {"tile_kernel": table}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
