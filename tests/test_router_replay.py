"""RoutingRecord files and converters: round trip, refusal of mismatched records, replay from a file."""

import os

import numpy as np
import pytest

import jaxalign as ja
from jaxalign.align.replay import from_slime, from_verl, load_record, save_record, to_slime

from conftest import build_model

FP32 = ja.NumericPolicy.preset("fp32")


@pytest.fixture(scope="module")
def rollout():
    model = build_model("tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n) for n in (3, 7, 5)]
    return model, ja.generate(model, prompts, FP32, max_new_tokens=6, temperature=1.0, seed=1)


def test_save_load_round_trip_and_replay_from_file(rollout, tmp_path):
    model, r = rollout
    path = tmp_path / "routing.safetensors"
    save_record(r.routing, path, config=model.config, policy=str(FP32))
    assert not os.path.exists(str(path) + ".tmp")
    loaded, meta = load_record(path, config=model.config)
    np.testing.assert_array_equal(loaded.indices, r.routing.indices)
    np.testing.assert_array_equal(loaded.weights, r.routing.weights)
    assert meta["policy"] == str(FP32) and meta["config_fingerprint"] == model.config.fingerprint()
    assert meta["layout"] == "batch,seq,moe_layers,k"
    a, _ = ja.token_logprobs(model, r.tokens, FP32, replay=loaded)
    b, rec = ja.token_logprobs(model, r.tokens, FP32, replay=r.routing)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    forwarded = r.routing.indices >= 0
    np.testing.assert_array_equal(np.asarray(rec.indices)[forwarded], r.routing.indices[forwarded])


def test_mismatched_records_are_refused(rollout, tmp_path):
    model, r = rollout
    path = tmp_path / "r.safetensors"
    save_record(r.routing, path, config=model.config)
    other = model.config.replace(n_experts=16)
    with pytest.raises(ValueError, match="recorded for model config"):
        load_record(path, config=other)
    with pytest.raises(ValueError, match="expected"):
        save_record(ja.RoutingRecord(r.routing.indices[..., :2], r.routing.weights[..., :2], r.routing.margins),
                    tmp_path / "bad.safetensors", config=model.config)
    bad = r.routing.indices.copy()
    bad[0, 0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"allowed: -1 \(not routed\) .. 7"):
        from_verl(bad, model.config)
    with pytest.raises(ValueError, match=r"allowed: -1 \(not routed\) .. 7"):
        ja.token_logprobs(model, r.tokens, FP32, replay=bad)
    assert not (tmp_path / "bad.safetensors").exists()


def test_slime_and_verl_converters(rollout):
    model, r = rollout
    lengths = r.prompt_lens + r.completion_lens
    per_seq = to_slime(r.routing, lengths)
    assert [a.shape[0] for a in per_seq] == list(lengths - 1)  # the last sampled token is never forwarded
    back = from_slime(per_seq, model.config, seq_len=r.tokens.shape[1])
    np.testing.assert_array_equal(back.indices, r.routing.indices)
    verl = from_verl(r.routing.indices.astype(np.int16), model.config)
    assert verl.indices.dtype == np.int32
    np.testing.assert_array_equal(verl.indices, r.routing.indices)
    with pytest.raises(ValueError, match="slime layout"):
        from_slime([np.zeros((3, 2), np.int32)], model.config)
