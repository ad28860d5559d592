"""XLA:CPU's YNNPACK reduce fusions: above ~7k float32 elements XLA:CPU hands a reduce and the elementwise ops
around it (a softmax's max, subtract and exp) to YNNPACK, whose exp rounds differently from XLA's own, so the
same logits got other softmax bits in a large program than in a small one. In an aligned Countdown RL run this
split the trainer's full forward (256 x 38 tokens: YNNPACK) from the engine's 256-row decode step (XLA's exp) at
one step in 60 (KL 2e-6, max |dlogp| 0.0064). `import jaxalign` turns these fusions off
(`jaxalign/runtime.py`); the tests here hold the saved case and the mechanism."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxalign
from jaxalign import ModelConfig, NumericPolicy, Transformer, token_logprobs
from jaxalign.runtime import YNN_REDUCE_OFF, _ynn_reduce_enabled

from isa import child_xla_flags, probe_with_flag

ALIGNED = NumericPolicy.preset("aligned-bf16")
CASE = os.path.join(os.path.dirname(__file__), "data", "rl_step34_case.npz")

# layer 0's router logits of the token whose gate weights split trainer from engine (row 64, position 18, step 34)
STEP34_ROUTER_LOGITS = np.array([0xbec15f26, 0x3f908770, 0x3e0a4958, 0x3fb13493, 0xbe9fe4b1, 0xbfa4f1e3,
                                 0xbf6cc00c, 0xbe1354d8], np.uint32).view(np.float32)


def load_case():
    """The step-34 case: the countdown model's weights after step 33 (bf16-rounded, as both sides use them under
    aligned-bf16; the f32 router as is) and 24 rows of that step's rollout (rows 56..79 of its 256-row batch, the
    failing group 64..71 among them): their prompts and lengths, the step's sampling seed, and the tokens and
    mask the engine generated there -- a trainer batch of 24 x 38 tokens."""
    case = np.load(CASE)
    params = {}
    for key in case.files:
        kind, _, name = key.partition(":")
        if kind not in ("f32", "bf16"):
            continue
        value = case[key] if kind == "f32" else case[key].view(ml_dtypes.bfloat16).astype(np.float32)
        node = params
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(int(part) if part.isdigit() else part, {})
        node[leaf] = value
    model = Transformer(ModelConfig.preset("countdown"), rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model, case


# the case's engine settings: the RL run's (temperature 1, the tokenizer's EOS, 14 new tokens), its requests
# keep their ids in the step's batch, so they draw the step's random numbers
CASE_REQUESTS = np.arange(56, 80)
CASE_MAX_NEW = 14


@pytest.mark.bitwise
def test_rl_step34_trainer_batch_scores_the_engine_tokens_bitwise():
    """The saved case: the engine regenerates the 24 rows on this host, and the trainer's logprobs of them in one
    24 x 38 batch (the trainer's padded width; its router softmax is large enough for a YNNPACK fusion) are
    those of each 8-row group scored alone (too small for one) and the engine's, bit for bit. Before the fix 61
    tokens of rows 64..71 differed, from position 18 on, through layer 0's gate weights.

    The engine's logprobs are computed here: bits are promised within one host, not across hosts
    (docs/policies.md, "Across hosts"). The file keeps the ones the run recorded on its AVX-512 Xeon
    (`lp_engine`); on an AMX Xeon (Emerald Rapids) this code's differ from them in 10 tokens under every
    --xla_cpu_max_isa, the tokens being the same: XLA:CPU hands bf16 products to YNNPACK, which picks its
    kernels by the CPU's features at run time."""
    from jaxalign import generate
    from jaxalign.rl import tokenizer
    model, case = load_case()
    saved = case["tokens"]
    prompts = [row[:n] for row, n in zip(saved.astype(np.int32), case["prompt_lens"])]
    rollout = generate(model, prompts, ALIGNED, max_new_tokens=CASE_MAX_NEW, temperature=1.0,
                       eos_id=tokenizer.EOS, seed=int(case["seed"]), request_ids=CASE_REQUESTS)
    width = saved.shape[1]
    tokens = np.full((len(prompts), width), tokenizer.PAD, np.int32)
    tokens[:, :rollout.tokens.shape[1]] = rollout.tokens
    mask = np.zeros((len(prompts), width - 1), bool)
    mask[:, :rollout.mask.shape[1]] = rollout.mask
    lp_engine = np.zeros(mask.shape, np.float32)
    lp_engine[:, :rollout.logprobs.shape[1]] = rollout.logprobs

    lp = np.asarray(token_logprobs(model, tokens, ALIGNED, temperature=1.0)[0])
    groups = np.concatenate([np.asarray(token_logprobs(model, tokens[i:i + 8], ALIGNED, temperature=1.0)[0])
                             for i in range(0, len(tokens), 8)])
    assert mask[8:16].sum() > 0
    for other in (groups, lp_engine):
        differing = np.argwhere((lp != other) & mask)
        assert differing.size == 0, differing[:10]


@pytest.mark.bitwise
def test_a_softmax_row_does_not_depend_on_the_array_around_it():
    """The mechanism on the saved logits: the aligned softmax and log-softmax of that row inside a [912, 8]
    array (the size at which XLA:CPU chose YNNPACK) are those of the row alone."""
    import jax

    from jaxalign.numerics.reduce import log_softmax, softmax

    rows = np.random.default_rng(0).standard_normal((912, 8)).astype(np.float32)
    rows[18] = STEP34_ROUTER_LOGITS
    for fn in (lambda x: softmax(x, ALIGNED, "f32"), lambda x: log_softmax(x, ALIGNED)):
        big = np.asarray(jax.jit(fn)(rows))
        alone = np.concatenate([np.asarray(jax.jit(fn)(rows[i:i + 1])) for i in (18, 0, 1, 2, 3)])
        np.testing.assert_array_equal(big[[18, 0, 1, 2, 3]], alone)


_EXP_PROBE = """
import numpy as np, jax, jax.numpy as jnp
import jaxalign
x = np.random.default_rng(0).standard_normal((9728, 8)).astype(np.float32)
f = jax.jit(lambda x: jnp.exp(x - jnp.max(x, -1, keepdims=True)))
whole = np.asarray(f(x))
pieces = np.concatenate([np.asarray(f(x[i:i + 38])) for i in range(0, len(x), 38)])
print(int((whole != pieces).any(-1).sum()))
"""


@pytest.mark.bitwise
def test_ynn_reduce_fusions_are_off_and_would_make_exp_depend_on_the_batch():
    """jaxalign sets the flag at import; a child that turns YNNPACK reduce fusions back on gets another exp for
    a [9728, 8] array than for its [38, 8] pieces (each case in its own process)."""
    assert jaxalign.EXACT_ELEMENTWISE and YNN_REDUCE_OFF in os.environ["XLA_FLAGS"]
    rows = {value: int(probe_with_flag(_EXP_PROBE, "--xla_cpu_experimental_ynn_fusion_type", value))
            for value in ("-reduce", "+reduce")}
    assert rows["-reduce"] == 0
    assert rows["+reduce"] > 0


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
    print("refused:", "YNNPACK" in str(err))
else:
    print("ran")
"""


def test_a_user_who_keeps_ynn_reduce_fusions_gets_aligned_policies_refused():
    env = dict(os.environ, XLA_FLAGS=child_xla_flags("--xla_cpu_experimental_ynn_fusion_type=+reduce"))
    out = subprocess.run([sys.executable, "-c", _REFUSAL_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "refused: True"


@pytest.mark.parametrize("flags, enabled", [
    ("", True), ("--xla_cpu_experimental_ynn_fusion_type=-reduce", False),
    ("--xla_cpu_experimental_ynn_fusion_type=+dot", True), ("--xla_cpu_experimental_ynn_fusion_type=dot", False),
    ("--xla_cpu_experimental_ynn_fusion_type=dot,reduce", True),
    ("--xla_cpu_experimental_ynn_fusion_type=-reduce --xla_cpu_experimental_ynn_fusion_type=+reduce", True),
])
def test_ynn_flag_parsing(flags, enabled):
    assert _ynn_reduce_enabled(flags) is enabled
