"""The engine's promise on DeepSeek-V4 (tiny-deepseek-v4: HCA, CSA with its indexer and sliding-only layers over a
window shorter than prompt plus completion, sinks, hyper-connection streams, a hash-routed layer, sqrtsoftplus
routing, the SwiGLU limit): under aligned-bf16 its logprobs equal the trainer's bitwise for 6 prompts, static (batch
4, prefill in chunks of 4) and continuous (4 slots, two refills). The held-out transformers checkpoint's parity is
tests/test_deepseek_v4.py."""

import pytest

from jaxalign import NumericPolicy

from conftest import build_model

ALIGNED = NumericPolicy.preset("aligned-bf16")


CONTINUOUS = pytest.mark.full_matrix(
    cover="tests/test_deepseek_v4_engine.py::test_aligned_engine_equals_the_trainer_bitwise[static-4]",
    why="the second schedule of the same claim (continuous batching with refills: 40 s more on 2 cores)")


@pytest.mark.bitwise
@pytest.mark.parametrize("schedule, chunk", [("static", 4), pytest.param("continuous", None, marks=CONTINUOUS)])
def test_aligned_engine_equals_the_trainer_bitwise(schedule, chunk):
    """6 prompts of up to 16 tokens and 12 new ones (window and HCA entries of 8, CSA entries of 4), static batch 4
    with prefill in chunks of 4 / continuous batching on 4 slots."""
    from jaxalign.align.compare import compare
    run = compare(build_model("tiny-deepseek-v4"), ALIGNED, ALIGNED, n_prompts=6, max_new_tokens=12,
                  engine_batches=(4,), schedule=schedule, prefill_chunk=chunk)["runs"][0]
    assert run["bitwise_equal_fraction"] == 1.0 and run["max_abs_logp_diff"] == 0.0, run
    assert run["k3_kl"] == 0.0 and run["route_flip_rate"] == 0.0 and run["n_tokens"] == 6 * 12
