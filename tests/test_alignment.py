"""The alignment claims: aligned-bf16 is bitwise on both sides; the misaligned pair has a measurable gap;
router replay alone does not close it; localize names the culprit."""

import pytest

from jaxalign import NumericPolicy
from jaxalign.align.compare import compare
from jaxalign.align.localize import check_attributions, localize

from conftest import build_model

ALIGNED = NumericPolicy.preset("aligned-bf16")


# aligned-bf16 on `small`, and aligned-fp8 (W8A8 on both sides, numerics/fp8.py) on `tiny` (its 16x16 blocks
# are the presets' tiny-model scale); the first ids are the aligned-bf16 cases' (tests/isa.py names them)
@pytest.mark.parametrize("policy_name, preset, schedule, batches, chunk", [
    pytest.param("aligned-bf16", "small", "static", (1, 3, 8, 32), None, id="static-batches0-None"),
    pytest.param("aligned-bf16", "small", "continuous", (3, 8), None, id="continuous-batches1-None"),
    pytest.param("aligned-bf16", "small", "static", (8,), 4, id="static-batches2-4"),
    pytest.param("aligned-fp8", "tiny", "static", (1, 3, 8, 32), None, id="fp8-static", marks=pytest.mark.full_matrix(
        cover="tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule[fp8-continuous]",
        why="aligned-fp8 at four static batches: the continuous case (batches 3 and 8) and the chunked one")),
    pytest.param("aligned-fp8", "tiny", "continuous", (3, 8), None, id="fp8-continuous"),
    pytest.param("aligned-fp8", "tiny", "static", (8,), 4, id="fp8-chunked-prefill"),
    # the gated DeltaNet hybrid: recurrent and conv states carried across prefill chunks, decode steps and slots
    # static batches 1/3/32 of the hybrid (JAXALIGN_MATRIX=full): a row's states are its own whatever the batch, as
    # its continuous case (refilled slots) and the held-out checkpoint's static batch (tests/test_hf_interop.py) show
    pytest.param("aligned-bf16", "tiny-qwen3.5", "static", (1, 3, 32), None, id="hybrid-static",
                 marks=pytest.mark.full_matrix(
                     cover="tests/test_alignment.py::test_aligned_is_bitwise_for_every_batch_and_schedule"
                           "[hybrid-continuous]", why="the hybrid at three more static batch sizes")),
    pytest.param("aligned-bf16", "tiny-qwen3.5", "continuous", (4,), None, id="hybrid-continuous"),
    pytest.param("aligned-bf16", "tiny-qwen3.5", "static", (8,), 4, id="hybrid-chunked-prefill"),
])
@pytest.mark.bitwise
def test_aligned_is_bitwise_for_every_batch_and_schedule(policy_name, preset, schedule, batches, chunk):
    model = build_model(preset)
    policy = NumericPolicy.preset(policy_name)
    result = compare(model, policy, policy, n_prompts=32, max_new_tokens=12, engine_batches=batches,
                     schedule=schedule, prefill_chunk=chunk, seed=1)
    for run in result["runs"]:
        assert run["max_abs_logp_diff"] == 0.0, run
        assert run["bitwise_equal_fraction"] == 1.0
        assert run["route_flip_rate"] == 0.0 and run["k3_kl"] == 0.0 and run["kl"] == 0.0


def test_misaligned_pair_has_a_gap_and_route_flips():
    """Notebook 02's first comparison, with its settings: the notebook loads these programs from the run's cache
    (tests/conftest.py SHARED_PROGRAMS runs this file before the notebooks on one worker)."""
    model = build_model("small")
    result = compare(model, NumericPolicy.preset("train-bf16"), NumericPolicy.preset("serve-bf16"),
                     n_prompts=48, max_new_tokens=48, engine_batches=(8,), seed=0)
    run = result["runs"][0]
    assert run["k3_kl"] > 0 and run["route_flip_rate"] > 0 and run["max_abs_logp_diff"] > 0


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-qwen3.5", marks=pytest.mark.full_matrix(
    cover="tests/test_alignment.py::test_replay_alone_is_insufficient_but_matching_the_combine_closes_the_gap[tiny]",
    why="the same decomposition on the hybrid (its MoE layers are the default model's kind)"))])
def test_replay_alone_is_insufficient_but_matching_the_combine_closes_the_gap(preset):
    """R3 replay makes the experts agree, the combine path still differs; switching only the combine fields
    of the engine to the trainer's brings the gap to exactly zero (kernels batch invariant on both sides).
    On the Qwen3.5 hybrid (top-4) this is the seed's finding: transformers' eager experts path (bf16 router
    weights, one bf16 index_add per expert) against its grouped_mm path (the weighted outputs summed in f32,
    cast once); both sides run the recurrent delta rule."""
    model = build_model(preset)  # top-4: the combine order matters
    invariant = ",kernel=tiled:8,reduce=tree" + (",delta=recurrent" if preset == "tiny-qwen3.5" else "")
    trainer = NumericPolicy.parse("hf-grouped-bf16" + invariant)
    engine = NumericPolicy.parse("hf-eager-bf16" + invariant)
    assert {f for f, _, _ in trainer.diff(engine)} == {"combine_acc_dtype", "combine_order"}
    kw = dict(replay="r3", n_prompts=16, max_new_tokens=16, engine_batches=(8,), seed=2)
    replayed = compare(model, trainer, engine, **kw)["runs"][0]
    assert replayed["route_flip_rate"] == 0.0
    assert replayed["k3_kl"] > 0 and replayed["max_abs_logp_diff"] > 0
    matched = engine.replace(combine_acc_dtype=trainer.combine_acc_dtype, combine_order=trainer.combine_order)
    closed = compare(model, trainer, matched, **kw)["runs"][0]
    assert closed["max_abs_logp_diff"] == 0.0 and closed["k3_kl"] == 0.0
    # what localize names on the hybrid, and the MoE-block swap, per top-k: tests/test_aggregation.py


@pytest.mark.parametrize("planted", [
    ("router_logits_dtype", "bf16"),
    ("combine_acc_dtype", "bf16"),
    ("kv_cache_dtype", "bf16"),
])
def test_localize_names_the_planted_culprit(planted):
    """Trainer fp32; engine fp32 plus the planted field and a benign difference (tiled kernel in fp32). Only the
    fields are attributed: the parts and modules would be six more programs, which the hf-pair test runs."""
    model = build_model("tiny")
    trainer = NumericPolicy.preset("fp32")
    engine = trainer.replace(matmul_kernel="tiled:8", **{planted[0]: planted[1]})
    result = localize(model, trainer, engine, n_prompts=8, max_new_tokens=12, seed=3, attribute=("fields",))
    assert result["culprit"] == planted[0], result["fields"]
    assert result["fields"][0]["score"] > 10 * result["fields"][1]["score"]
    assert result["attributed"] == ["fields"] and result["parts"] == [] and result["modules"] == []


def test_localize_refuses_an_unknown_attribution_before_it_generates():
    model = build_model("tiny")
    for bad, says in [(("fields", "layers"), "unknown: 'layers'"), ((), "one or more of fields, parts, modules"),
                      (("parts", "parts"), "each once")]:
        with pytest.raises(ValueError, match=says):
            localize(model, NumericPolicy.preset("fp32"), NumericPolicy.preset("serve-bf16"), attribute=bad)
    assert check_attributions("modules, fields") == ("fields", "modules")  # the CLI's comma-separated form


def test_localize_ranks_the_combine_path_first_for_hf_paths():
    """Notebook 01's hf pair, with its settings (its field and module programs are the notebook's), and the parts
    the notebook leaves out: joined to the trainer's policy one by one, in model order, they close the gap exactly,
    and only the MoE layers (where the combine paths differ) carry any of it."""
    model = build_model("tiny")
    result = localize(model, NumericPolicy.preset("hf-grouped-bf16"), NumericPolicy.preset("hf-eager-bf16"),
                      n_prompts=8, max_new_tokens=16, seed=0, replay="r3")
    assert result["culprit"] in ("combine_acc_dtype", "combine_order")
    mlp = [m for m in result["modules"] if m["module"] == "mlp"][0]
    assert mlp["k3_with_module_from_trainer"] == 0.0  # swapping the MoE blocks closes it (the seed's method)
    parts = {p["part"]: p for p in result["parts"]}
    assert set(parts) == {"embed", "layer0", "layer1", "head"} and result["baseline"]["k3_kl"] > 0
    assert parts["head"]["k3_after_joining_trainer"] == 0.0  # every part under the trainer's policy: no gap
    assert parts["embed"]["contribution"] == 0.0 and parts["head"]["contribution"] == 0.0
    assert parts["layer1"]["k3_after_joining_trainer"] == 0.0
    assert sum(p["contribution"] for p in result["parts"]) == pytest.approx(result["baseline"]["k3_kl"], rel=1e-12)


_FUSION_PROBE = """
import jax, jax.numpy as jnp
from jaxalign import NumericPolicy
from jaxalign.numerics.attention import rope
p = NumericPolicy.parse('aligned-bf16')  # RoPE rotation in bf16
x = jax.random.normal(jax.random.key(0), (2, 16, 4, 8)).astype(jnp.bfloat16)
pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
consume = lambda y: jnp.sum(y.astype(jnp.float32) * 3.0, axis=-1)
apart = jax.jit(consume)(jax.jit(lambda x: rope(x, pos, 1e4, p))(x))  # RoPE's output materialised in bf16
fused = jax.jit(lambda x: consume(rope(x, pos, 1e4, p)))(x)  # the same ops, fused into their consumer
print(float(jnp.max(jnp.abs(apart - fused))))
"""


@pytest.mark.bitwise
def test_excess_precision_is_off_and_would_make_bf16_bits_depend_on_fusion():
    """With XLA's default excess precision, a bf16 elementwise chain is computed in f32 and rounded only at
    fusion boundaries: the same bf16 RoPE hands its consumer other values when it is fused into it than when its
    output is materialised -- and engine decode and trainer forward fuse differently (this once made one key's
    RoPE differ by a bf16 ulp between them in an RL run). jaxalign turns excess precision off at import, so the
    two agree; a user who forces it back on gets the difference (each case in its own process)."""
    import os

    import jaxalign
    from isa import probe_with_flag

    assert jaxalign.EXACT_LOW_PRECISION and "--xla_allow_excess_precision=false" in os.environ["XLA_FLAGS"]
    gaps = {flag: float(probe_with_flag(_FUSION_PROBE, "--xla_allow_excess_precision", flag))
            for flag in ("false", "true")}
    assert gaps["false"] == 0.0
    assert gaps["true"] > 0.0


_REFUSAL_PROBE = """
import numpy as np
import jaxalign as ja
from flax import nnx
model = ja.Transformer(ja.ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
tokens = np.zeros((1, 4), np.int32)
ja.token_logprobs(model, tokens, ja.NumericPolicy.preset("train-bf16"))  # no bitwise promise: runs
try:
    ja.token_logprobs(model, tokens, ja.NumericPolicy.preset("aligned-bf16"))
except ValueError as err:
    print("refused:", "excess precision" in str(err))
else:
    print("ran")
"""


def test_aligned_policy_is_refused_when_the_user_forces_excess_precision_on():
    """With excess precision forced on, an aligned bf16 policy cannot keep its trainer == engine promise, so it is
    refused with an error that names the flag; a policy without that promise still runs."""
    import os
    import subprocess
    import sys

    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_allow_excess_precision=false", "")
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_allow_excess_precision=true".strip())
    out = subprocess.run([sys.executable, "-c", _REFUSAL_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "refused: True"
