"""The batch-invariant kernels on the backend at hand, small shapes: which implementation each ran with, whether a
row's bits are the same alone and in batches, and the error against float64.

    python benchmarks/device_kernels.py [--out FILE] [--simulate gpu|tpu]

On the CPU `tiled:8` is the lax tiled kernel; on a GPU/TPU it is the Pallas kernels with blocks derived from T
(jaxalign/numerics/kernels.py), compiled -- so on a lent GPU this is the first run of the Triton lowering.
Cases: the dense product (aligned-bf16, bf16 operands), its gradient, the sorted dispatch's grouped product
(each row vs its expert alone) and chunked attention (chunks of 16 -- 128 on a TPU --, head dim 16: a query
alone vs in a prefill batch). Each case is run in its own try block: an error is recorded, not fatal.
`--simulate gpu|tpu` (on a CPU): the kernels chosen as on that platform, run in interpret mode.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402,I001


def _bits(a):
    import numpy as np
    return np.asarray(a, np.float32).view(np.uint32)


def _rel_err(got, ref_fn, *operands) -> float:
    """max |got - ref| / max |ref|, ref computed in float64 by `ref_fn`."""
    import numpy as np
    ref = ref_fn(*(np.asarray(o, np.float64) for o in operands))
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-300))


def cases(platform: str) -> dict:
    """name -> function returning {bitwise_invariant, rel_err_vs_f64, ...}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxalign.numerics import NumericPolicy
    from jaxalign.numerics.attention import attention
    from jaxalign.numerics.matmul import grouped_matmul, matmul

    policy = NumericPolicy.preset("aligned-bf16")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((33, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)

    def dense():
        run = jax.jit(lambda x: [matmul(x[:b], w, policy, out_dtype="f32") for b in (1, 7, 16, 33)])
        out = run(x)
        full = np.asarray(out[-1])
        same = all(np.array_equal(_bits(o), _bits(full[:o.shape[0]])) for o in out)
        return {"bitwise_invariant": same, "rel_err_vs_f64": _rel_err(full, lambda a, b: a @ b, x, w)}

    def gradient():
        c = jnp.asarray(rng.standard_normal((33, 48)), jnp.float32)
        loss = lambda x, w: jnp.sum(c * matmul(x, w, policy, out_dtype="f32"))  # noqa: E731
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x.astype(jnp.float32), w.astype(jnp.float32))
        return {"rel_err_dx_vs_f64": _rel_err(dx, lambda c, w: c @ w.T, c, w),
                "rel_err_dw_vs_f64": _rel_err(dw, lambda x, c: x.T @ c, x, c)}

    def grouped():
        sizes = np.array([5, 0, 11, 17], np.int32)
        we = jnp.asarray(rng.standard_normal((4, 64, 48)), jnp.bfloat16)
        expert_of = np.repeat(np.arange(4), sizes)
        run = jax.jit(lambda x, we: (grouped_matmul(x, we, jnp.asarray(sizes), policy),
                                     [grouped_matmul(x[expert_of == e], we[e:e + 1],
                                                     jnp.asarray([int(sizes[e])], jnp.int32), policy)
                                      for e in range(4) if sizes[e]]))
        y, alone = run(x, we)
        same = np.array_equal(_bits(y), _bits(np.concatenate([np.asarray(a) for a in alone])))
        ref = np.concatenate([np.asarray(x, np.float64)[expert_of == e] @ np.asarray(we[e], np.float64)
                              for e in range(4) if sizes[e]])
        err = float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))
        return {"bitwise_invariant": same, "rel_err_vs_f64_bf16_out": err}

    def chunked_attention():
        chunk = 128 if platform == "tpu" else 16
        p = policy.replace(attention=f"chunked:{chunk}")
        b, nq, h, kvh, d, nk = 2, 5, 4, 2, 16, 40
        q = jnp.asarray(rng.standard_normal((b, nq, h, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((b, kvh, d, nk)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, kvh, nk, d)), jnp.bfloat16)
        q_pos = jnp.asarray([[10, 11, 12, 13, 14], [30, 31, 32, 33, 34]], jnp.int32)
        k_pos = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
        run = jax.jit(lambda q, k, v, qp, kp: attention(q, k, v, qp, kp, p))
        full = run(q, k, v, q_pos, k_pos)
        alone = run(q[1:, 4:], k[1:], v[1:], q_pos[1:, 4:], k_pos[1:])
        return {"chunk": chunk,
                "bitwise_invariant": bool(np.array_equal(_bits(alone), _bits(np.asarray(full)[1:, 4:])))}

    return {"dense_matmul": dense, "matmul_gradient": gradient, "grouped_matmul": grouped,
            "chunked_attention": chunked_attention}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/device_kernels.json")
    parser.add_argument("--simulate", choices=("gpu", "tpu"), help="choose kernels as on this platform")
    args = parser.parse_args(argv)
    import contextlib

    import jax

    from jaxalign.numerics import kernels, platforms
    platform = args.simulate or platforms.host_platform()
    rows = []
    for name, fn in cases(platform).items():
        start = time.perf_counter()
        with (platforms.simulate(args.simulate) if args.simulate else contextlib.nullcontext()), \
                kernels.recording() as ran:
            try:
                row = {"case": name, "status": "ran", **fn()}
            except Exception as err:  # recorded for the report: a lowering that fails here is a result
                row = {"case": name, "status": "error", "error": f"{type(err).__name__}: {err}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}
        row.update(seconds=time.perf_counter() - start, implementations=sorted(ran))
        rows.append(row)
        print({k: v for k, v in row.items() if k != "traceback"}, flush=True)
    write_json(args.out, {"args": vars(args), "backend": jax.default_backend(), "platform": platform,
                          "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows})
    return 0 if all(r["status"] == "ran" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
