"""Every matrix product jaxalign compiles states its precision, decided by the policy (issue 13).

The audit lowers every program (trainer forward and gradient, engine prefill + decode, chunked prefill,
continuous batching, the RL update) under every preset and a few policies that reach the remaining product
sites (gather/bucketed/capacity dispatch, emulated bf16 accumulation, tiled kernels, LoRA), and fails on any
dot whose precision or accumulation is left to the backend. Lowering only: nothing is compiled.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxalign.align.audit import PROGRAMS, audit, lower_programs, products
from jaxalign.rl.lowering import lower_update
from jaxalign.numerics import PRESETS, NumericPolicy
from jaxalign.numerics.platforms import float16_error
from jaxalign.numerics.precision import check_backend, float16_fields, runs_on

from conftest import build_lora_model, build_model, forward_logits, random_tokens

RUNNABLE = [name for name, policy in PRESETS.items() if runs_on(policy)]
# product sites no preset reaches: the other expert dispatches, emulated bf16 accumulation (chunked ragged_dot),
# the tiled kernel with low-precision operands, chunked attention with tree sums, a separate backward precision
EXTRA = ["fp32,dispatch=gather", "fp32,dispatch=bucketed", "fp32,dispatch=capacity:1.0", "train-bf16,matmul=bf16",
         "serve-bf16,kernel=tiled:8", "fp32,attn=chunked:4,reduce=tree", "fp32,matmul_bwd=BF16_BF16_F32",
         "aligned-bf16,matmul_bwd=f32", "train-bf16,matmul_bwd=BF16_BF16_F32"]


def _text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_audit_flags_products_left_to_the_backend():
    """The audit can fail: DEFAULT precision, and bf16 x bf16 -> bf16, are flagged; HIGHEST with an f32 result
    and an algorithm are not."""
    a, b = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 3), jnp.float32)
    lo_a, lo_b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    default = products(_text(lambda x, y: x @ y, a, b))
    assert len(default) == 1 and "precision left to the backend" in default[0].problem
    low = products(_text(lambda x, y: jnp.dot(x, y, precision=lax.Precision.HIGHEST), lo_a, lo_b))
    assert low[0].operand_types == ("bf16", "bf16") and "accumulation left to the backend" in low[0].problem
    good = products(_text(lambda x, y: jnp.dot(x, y, precision=lax.Precision.HIGHEST,
                                               preferred_element_type=jnp.float32), lo_a, lo_b))
    assert good[0].result_type == "f32" and good[0].problem is None
    algo = products(_text(lambda x, y: jnp.dot(x, y, precision=lax.DotAlgorithmPreset.BF16_BF16_F32), a, b))
    assert algo[0].algorithm and algo[0].problem is None
    found = audit({"bad": _text(lambda x, y: x @ y, a, b)})
    assert found["products"] == 1 and len(found["problems"]) == 1


@pytest.mark.parametrize("name", RUNNABLE + EXTRA)
def test_every_program_states_its_precision(name):
    """Presets: every program. The extra policies reach other product sites of the same model code: their
    forward and gradient (plus the engine for the dispatches decode uses)."""
    policy = NumericPolicy.parse(name)
    model = build_model("tiny")
    if name in RUNNABLE:
        texts = lower_programs(model, policy, PROGRAMS)
        texts["rl-update"] = lower_update(model, policy)
    else:
        texts = lower_programs(model, policy, ("forward", "gradient", "engine"))
    found = audit(texts)
    assert all(n > 0 for n in found["per_program"].values()), found["per_program"]
    assert found["problems"] == [], found["problems"][:5]


@pytest.mark.parametrize("lora", ["merged", "unmerged"])
def test_lora_programs_state_their_precision(lora):
    """LoRA's low-rank path and its merge (the trainer merges at use) in the forward and the gradient."""
    policy = NumericPolicy.preset("aligned-bf16").replace(lora=lora)
    found = audit(lower_programs(build_lora_model(), policy, ("forward", "gradient")))
    assert found["products"] > 0 and found["problems"] == [], found["problems"][:5]


def test_presets_the_cpu_cannot_run_fail_early_and_clearly():
    """`fp32-tf32` names TF32, which JAX refuses on XLA:CPU: the error names the field, the value, the backend
    and what is allowed, and comes at trace time (before any compile)."""
    policy = NumericPolicy.preset("fp32-tf32")
    # fp16 as well where XLA:CPU cannot compile float16 (test_float16_is_refused_where_xla_cpu_cannot_compile_it)
    no_f16 = ["fp16"] if jax.default_backend() == "cpu" and float16_error() else []
    assert [n for n in PRESETS if n not in RUNNABLE] == (["fp32-tf32"] + no_f16 if jax.default_backend() == "cpu"
                                                         else [])
    if jax.default_backend() != "cpu":
        pytest.skip("TF32 runs on this backend")
    for call in (lambda: check_backend(policy),
                 lambda: forward_logits(build_model("tiny"), random_tokens(build_model("tiny").config, 1, 4), policy),
                 lambda: check_backend(policy.replace(matmul_acc="f32", matmul_bwd="TF32_TF32_F32"))):
        with pytest.raises(ValueError, match=r"matmul_(acc|bwd) = 'TF32_TF32_F32'.*cpu backend.*allowed on cpu: "
                                             r"(f32, bf16, f16|same, f32), DEFAULT, .*BF16_BF16_F32"):
            call()
    assert runs_on(policy, "gpu")


# In a fresh process under the ISA cap given: whether fp16 and aligned-bf16 can run, and check_backend's message
_FLOAT16_PROBE = """
import json
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.platforms import float16_error
from jaxalign.numerics.precision import check_backend, runs_on
try:
    check_backend(NumericPolicy.parse("fp32,kv=f16"), label="--engine")
    message = None
except ValueError as exc:
    message = str(exc)
print(json.dumps({"error": float16_error(), "fp16": runs_on(NumericPolicy.preset("fp16")),
                  "aligned": runs_on(NumericPolicy.preset("aligned-bf16")), "message": message}))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU limitation")
def test_float16_is_refused_where_xla_cpu_cannot_compile_it():
    """Without F16C (here: `--xla_cpu_max_isa=SSE4_2`) jaxlib 0.10.2's XLA:CPU cannot load any float16 program
    (its JIT lacks compiler-rt's half conversions). `check_backend` then refuses every policy with an f16 field,
    naming the fields, the flags and what is allowed, instead of the compile failing deep inside a run; under
    AVX (F16C) float16 compiles and runs."""
    import json

    from isa import probe_with_flag
    assert float16_fields(NumericPolicy.preset("fp16")) == ["param_dtype", "compute_dtype", "kv_cache_dtype"]
    assert float16_fields(NumericPolicy.parse("fp32,matmul=F16_F16_F16")) == ["matmul_acc"]
    assert float16_fields(NumericPolicy.preset("aligned-bf16")) == []
    sse = json.loads(probe_with_flag(_FLOAT16_PROBE, "--xla_cpu_max_isa", "SSE4_2"))
    assert "materialize symbols" in sse["error"] and not sse["fp16"] and sse["aligned"]
    assert re.search(r"--engine: NumericPolicy.kv_cache_dtype = 'f16' needs float16, which XLA:CPU cannot "
                     r"compile .*--xla_cpu_max_isa=SSE4_2.*allowed here: f32, bf16", sse["message"])
    avx = json.loads(probe_with_flag(_FLOAT16_PROBE, "--xla_cpu_max_isa", "AVX"))
    assert avx == {"error": None, "fp16": True, "aligned": True, "message": None}
    if float16_error() is None:  # this host: an fp16 program really runs
        out = forward_logits(build_model("tiny"), random_tokens(build_model("tiny").config, 1, 4),
                             NumericPolicy.preset("fp16"))[0]
        assert np.isfinite(np.asarray(out, np.float32)).all()


def _lowered(policy, program):
    return lower_programs(build_model("tiny"), policy, (program,))[program]


def test_matmul_bwd_knob_changes_only_the_gradient_products():
    """`matmul_bwd` gives the gradient's products their own precision; the forward's stay as they were. XLA:CPU
    ignores dot algorithms, so on the CPU the knob changes the program, not the numbers."""
    base = NumericPolicy.preset("fp32")
    flipped = base.replace(matmul_bwd="BF16_BF16_F32")
    assert _lowered(base, "forward") == _lowered(flipped, "forward")
    before, after = products(_lowered(base, "gradient")), products(_lowered(flipped, "gradient"))
    n_forward = len(products(_lowered(base, "forward")))
    assert len(before) == len(after) and not any(p.algorithm for p in before)
    assert sum(p.algorithm for p in after) == len(after) - n_forward > 0  # every backward product, no forward one
    assert _lowered(NumericPolicy.parse(str(flipped)).replace(matmul_bwd="same"), "gradient") == \
        _lowered(base, "gradient")


def test_dot_algorithm_presets_state_the_algorithm():
    """A `lax.DotAlgorithmPreset` in `matmul_acc` becomes every product's algorithm (forward and backward)."""
    for name in ("fp32-bf16pass", "fp32-bf16x3"):
        found = products(_lowered(NumericPolicy.preset(name), "gradient"))
        assert found and all(p.algorithm for p in found)


def test_transcendental_accuracy_knob_changes_the_program():
    """`transcendental=highest` asks XLA for the most accurate exp/log in every softmax and log-softmax and in
    SwiGLU's silu. XLA:CPU does not act on the request (its exp/log give the same bits; docs/policies.md), so
    the knob is shown in the program: every exponential and log of the forward carries the accuracy attribute,
    and none without it."""
    base = NumericPolicy.preset("aligned-bf16")
    before = _lowered(base, "forward")
    after = _lowered(base.replace(transcendental_accuracy="highest"), "forward")
    ops = lambda text: [line for line in text.splitlines()  # noqa: E731
                        if "stablehlo.exponential " in line or "stablehlo.log " in line]
    assert ops(before) and not any("result_accuracy" in line for line in ops(before))
    # JAX 0.10.2 lowers an op with `accuracy=` as an unused plain op (dead code, removed by XLA) followed by the
    # attributed one, which the program uses
    attributed = [line for line in ops(after) if "result_accuracy_mode<HIGHEST>" in line]
    assert len(attributed) == len(ops(before))


@pytest.mark.bitwise
def test_transcendental_accuracy_reaches_silu_and_the_sigmoids():
    """SwiGLU's silu, the sigmoid router and the shared-expert gate's sigmoid take the accuracy on their exp
    (`lax.logistic` drops an `accuracy=` when lowering in JAX 0.10.2, so `precision.logistic` writes its lowering
    out); with the default accuracy the program is `lax.logistic`'s / `jax.nn.silu`'s, op for op, and the bits
    and gradients are theirs."""
    from jaxalign.numerics.experts import router_sigmoid, sigmoid, swiglu

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)) * 6, jnp.bfloat16)
    default = NumericPolicy.preset("aligned-bf16")
    highest = default.replace(transcendental_accuracy="highest")
    functions = {"swiglu": lambda x, p: swiglu(x, x, p), "sigmoid": sigmoid, "router_sigmoid": router_sigmoid}
    for name, fn in functions.items():
        text = lambda p: jax.jit(lambda x: fn(x, p)).lower(x).as_text()  # noqa: E731
        exps = lambda t: [line for line in t.splitlines() if "stablehlo.exponential " in line]  # noqa: E731
        assert exps(text(default)) and not any("result_accuracy" in line for line in exps(text(default))), name
        assert any("result_accuracy_mode<HIGHEST>" in line for line in exps(text(highest))), name
    lax_silu = lambda x: (jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype) * x)  # the previous definition
    for got, ref in ((jax.jit(lambda x: swiglu(x, x, default))(x), jax.jit(lax_silu)(x)),
                     (jax.jit(jax.grad(lambda x: jnp.sum(swiglu(x, x, default).astype(jnp.float32))))(x),
                      jax.jit(jax.grad(lambda x: jnp.sum(lax_silu(x).astype(jnp.float32))))(x)),
                     (jax.jit(lambda x: router_sigmoid(x, default))(x),
                      jax.jit(lambda x: jax.nn.sigmoid(x.astype(jnp.float32)))(x))):
        np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                      np.asarray(ref, np.float32).view(np.uint32))

