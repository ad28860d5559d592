"""Does a product's bits depend on how its rows are laid out? One study, per policy, per shape and per YNNPACK
setting: `matmul(rows, w)` with row-major rows against the same rows handed over as a transposed array (XLA
folds the transpose into the product's dot).

    python benchmarks/tile_layout.py [--policies "aligned-bf16;fp32,kernel=tiled:8;train-bf16"]
                                     [--settings "jaxalign;-reduce,-dot,-individual_dot"]

A `tiled:T` tile's bits are promised to depend on its shape only. XLA:CPU hands a dot to YNNPACK only when the
dot's operands are laid out as YNNPACK wants them and runs the others in Eigen (upcast to f32), so on jaxlib
0.10.2 with jaxalign's flag (`-reduce`: YNNPACK's dots on) a one-tile product of transposed rows gave other bits
in float32 and did not run in bf16 (`UNIMPLEMENTED: ... BF16 x BF16 = F32`); with YNNPACK's dots off as well,
every dot runs in Eigen and the layouts agree. Each setting runs in its own process (`jaxalign` = the flag
`import jaxalign` sets; any other value is passed as `--xla_cpu_experimental_ynn_fusion_type`). Writes
benchmarks/results/tile_layout.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = ((8, 64, 16), (8, 64, 64), (24, 64, 16), (24, 64, 64))  # (rows, K, N): one tile and three of tiled:8
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def probe(policies: list[str]) -> list[dict]:
    """Every policy and shape in this process: row-major vs transposed rows, as table rows."""
    import jax
    import numpy as np

    from jaxalign import NumericPolicy
    from jaxalign.numerics.matmul import matmul
    rows = []
    for name in policies:
        policy = NumericPolicy.parse(name)
        for m, k, n in SHAPES:
            rng = np.random.default_rng(0)
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = rng.standard_normal((k, n)).astype(np.float32)
            row_major = np.asarray(jax.jit(lambda a, w, p=policy: matmul(a, w, p, out_dtype="f32"))(x, w))
            row = {"policy": name, "shape": f"[{m}, {k}] x [{k}, {n}]"}
            try:
                transposed = np.asarray(jax.jit(lambda a_t, w, p=policy: matmul(a_t.T, w, p, out_dtype="f32"))(
                    np.ascontiguousarray(x.T), w))
            except Exception as err:  # noqa: BLE001 - the failure is the finding
                row.update(result="fails", detail=str(err).splitlines()[0][:90])
            else:
                differ = transposed != row_major
                row.update(result="differs" if differ.any() else "equal",
                           detail=f"{differ.mean():.0%} of entries, max |delta| "
                                  f"{float(np.abs(transposed - row_major).max()):.2e}" if differ.any() else "")
            rows.append(row)
    return rows


def run_setting(setting: str, policies: str) -> list[dict]:
    """The probe in a fresh process under one YNNPACK setting."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(YNN_FLAG + "=")]
    if setting != "jaxalign":
        flags.append(f"{YNN_FLAG}={setting}")
    out = subprocess.run([sys.executable, __file__, "--probe", "--policies", policies],
                         env=dict(os.environ, XLA_FLAGS=" ".join(flags)), capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["(no output)"]
        last = next((line for line in lines if "Illegal value" in line or "Error" in line), lines[-1]).strip()
        raise SystemExit(f"--settings {setting!r}: the probe process failed ({last}); allowed: 'jaxalign' or a "
                         f"value of {YNN_FLAG}, e.g. -reduce,-dot,-individual_dot")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="aligned-bf16;fp32,kernel=tiled:8;train-bf16",
                        help="';'-separated policies")
    parser.add_argument("--settings", default="jaxalign;-reduce,-dot,-individual_dot",
                        help="';'-separated values of the YNNPACK fusion flag ('jaxalign': the one it sets)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "tile_layout.json"))
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(";") if p]
    if args.probe:
        print(json.dumps(probe(policies)))
        return 0
    from jaxalign import NumericPolicy
    try:
        for name in policies:
            NumericPolicy.parse(name)
    except ValueError as err:
        parser.error(str(err))
    settings = [s for s in args.settings.split(";") if s]
    rows = [{"ynn_setting": s, **row} for s in settings for row in run_setting(s, args.policies)]
    sys.path.insert(0, HERE)
    from common import write_json

    from jaxalign import report
    text = report.table(rows, ["ynn_setting", "policy", "shape", "result", "detail"])
    print(text)
    write_json(args.out, {"args": vars(args), "rows": rows, "tables": {"tile_layout": text}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
