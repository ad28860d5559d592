"""DeepSeek-V4 (`deepseek_v4`) against transformers 5.24's `DeepseekV4ForCausalLM`: a held-out checkpoint (random
weights; sinks, compressor position biases, hyper-connection bases and scales, router biases, norms and hash
tables perturbed so each matters) loads through the project's loader and gives transformers' fp32 logits over 96
tokens, full forward and cached decode both ways. Its layers mix every kind: HCA, CSA (indexer keeping 5 of up to
24 entries), sliding-only, two hash-routed MoE layers, three hyper-connection streams, YaRN on the compressed
layers. Also: the bitwise export,
and bad configs refused by name. The engine's side (aligned-bf16 bitwise) is tests/test_deepseek_v4_engine.py."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxalign as ja  # noqa: E402
from jaxalign.interop import hf  # noqa: E402
from jaxalign.loading import load_model  # noqa: E402

from conftest import forward_logits  # noqa: E402
from hf_checkpoints import (checkpoint, export_round_trip, our_cached_logits, reference_logits, token_ids,  # noqa: E402
                            transformers_cached_logits)

pytestmark = pytest.mark.hf
# transformers' indexer keeps torch.topk's choice among exactly tied scores (ReLU makes exact zeros common):
# hf-fp32 is fp32 with index_ties=torch-cpu (the default lower-slot ties are pinned as a difference below)
HF_FP32 = ja.NumericPolicy.preset("hf-fp32")
CONFIG = dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.5, n_routed_experts=8,
              num_experts_per_tok=2, routed_scaling_factor=1.5,
              layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                           "compressed_sparse_attention"],
              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
              compress_rope_theta=40000.0, rope_theta=10000.0, hc_mult=3, hc_sinkhorn_iters=7, sliding_window=16,
              o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=5, swiglu_limit=0.8,
              max_position_embeddings=128, initializer_range=0.1,
              # YaRN on the compressed layers, as the released V4 configs have it (transformers nests it under
              # rope_parameters.compress with attention_factor 1): over 32 original positions it rescales all but
              # the first two of the 8 rotary frequencies, and moves transformers' logits by ~2
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32.0, "beta_slow": 1.0})
SEQ = 96


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturbed(model):
    """Everything transformers initialises to a constant made to matter: sinks, position biases and mHC bases
    (zeros), mHC scales (ones), norms, the routers' correction biases, and the hash tables (zeros: every token to
    expert 0) as k distinct experts per token."""
    gen = torch.Generator().manual_seed(1)
    n_experts, k = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or "position_bias" in name or name.endswith(".base") or "hc_base" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(".scale") or "hc_scale" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.3)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory):
    torch.manual_seed(0)
    model = _perturbed(transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIG)))
    return checkpoint(model, tmp_path_factory, "deepseek_v4")


def _tokens(batch=2, seq=SEQ, seed=0):
    return token_ids(CONFIG["vocab_size"], batch, seq, seed)


_reference = reference_logits


def test_fp32_logits_match_transformers(deepseek_v4):
    """The loader reads every layer kind, the hash tables and the mHC weights; fp32 logits over 96 tokens within
    1e-4 of transformers (the window 16 and HCA entries of 16 tokens are shorter than the sequence, the indexer
    keeps 5 of up to 24 CSA entries). With lower-slot ties instead of torch's the indexer keeps other entries at
    exact ties and the logits move (the deliberate difference `index_ties` names)."""
    model, path = deepseek_v4
    ours = load_model(path)
    cfg, v4 = ours.config, ours.config.deepseek_v4
    assert cfg.family == "deepseek_v4" and cfg.router == "sqrtsoftplus" and cfg.n_kv_heads == 1
    assert cfg.layer_kinds == ("dsv4_hca", "dsv4_csa", "dsv4_sliding", "dsv4_csa")
    assert v4.hash_layers == (0, 1) and v4.hc_mult == 3 and v4.hc_iters == 7 and (v4.csa_rate, v4.hca_rate) == (4, 16)
    assert (v4.compress_yarn.factor, v4.compress_yarn.original_max_position) == (4.0, 32)
    table = model.model.layers[0].mlp.gate.tid2eid.numpy()
    np.testing.assert_array_equal(ours.blocks[0].mlp.table.array, table)
    assert len(np.unique(table[:, 0])) > 1
    tokens = _tokens()
    ref = _reference(model, tokens)
    assert np.abs(ref).max() > 1.0
    logits = np.asarray(forward_logits(ours, tokens, HF_FP32)[0])
    assert np.abs(logits - ref).max() <= 1e-4


@pytest.mark.full_matrix(cover="tests/test_deepseek_v4.py::test_fp32_logits_match_transformers",
                         why="a second compile of the 96-token forward (20 s on 2 cores) to pin a known difference")
def test_lower_slot_ties_differ_from_transformers(deepseek_v4):
    """The deliberate difference `index_ties` names: with the project's default lower-slot ties the indexer keeps
    other entries than torch.topk where scores tie exactly (ReLU makes exact zeros common), and the logits move."""
    model, path = deepseek_v4
    tokens = _tokens()
    lower_slot = np.asarray(forward_logits(load_model(path), tokens, HF_FP32.replace(index_ties="lower-slot"))[0])
    assert np.abs(lower_slot - _reference(model, tokens)).max() > 1e-2


def test_cached_decode_matches_transformers(deepseek_v4):
    """Our decode from the kinds' engine state (one token at a time from the first) gives transformers' decode from
    its cache (a prefill of 8, then one token at a time to 96: its compressors' buffers, overlap state and sliding
    cache) within 1e-4 in fp32. Both break the indexer's exact ties as torch.topk does over the entries complete
    so far -- which is not what transformers' own full forward does (its rows hold every entry of the sequence,
    the future ones at -inf), so transformers' cached and full logits differ at such ties (pinned here); ours
    follow each side: the full forward in test_fp32_logits_match_transformers, the decode here."""
    model, path = deepseek_v4
    ours = hf.load(path)
    tokens = _tokens(seed=1)
    prefill = 8
    theirs_cached = transformers_cached_logits(model, tokens, prefill)  # positions prefill - 1 .. SEQ - 2
    assert np.abs(theirs_cached - _reference(model, tokens)[:, prefill - 1:-1]).max() > 1e-2

    ours_cached = our_cached_logits(ours, tokens, HF_FP32, SEQ - 1)
    assert np.abs(ours_cached[:, prefill - 1:] - theirs_cached).max() <= 1e-4


def test_export_is_bitwise_and_loads_back_in_transformers(deepseek_v4, tmp_path):
    """hf.save writes the checkpoint's own tensors bit for bit under the names transformers writes (DeepSeek's:
    `attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`, the int64 `tid2eid`, ...) and a config transformers reads to
    the same logits; reading it back gives the same parameters and tables."""
    import jax
    from flax import nnx
    model, path = deepseek_v4
    out = str(tmp_path / "export")
    ours, theirs, written = export_round_trip(path, out)
    for name in theirs:
        assert written[name].dtype == theirs[name].dtype, name
        np.testing.assert_array_equal(written[name], theirs[name], err_msg=name)
        if theirs[name].dtype == np.float32:
            np.testing.assert_array_equal(written[name].view(np.uint32), theirs[name].view(np.uint32))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "DeepseekV4ForCausalLM" and loaded.config.layer_types == CONFIG["layer_types"]
    assert loaded.config.mlp_layer_types == CONFIG["mlp_layer_types"]
    tokens = _tokens(seed=2)
    assert np.abs(_reference(loaded, tokens) - _reference(model, tokens)).max() == 0.0
    again = hf.load(out)
    assert again.config == ours.config
    assert again.blocks[1].mlp.table == ours.blocks[1].mlp.table
    a, b = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (ours, again))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func = 'softmax' is not supported"),
    ({"num_key_value_heads": 2}, "num_key_value_heads = 2"),
    ({"n_shared_experts": 2}, "n_shared_experts = 2"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                   "original_max_position_embeddings": 32},
                          "compress": {"rope_type": "default", "rope_theta": 4e4}}},
     "rope_parameters.main.rope_type = 'yarn'"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 4e4, "attention_factor": 1.3,
                                       "original_max_position_embeddings": 32}}},
     "rope_parameters.compress.attention_factor = 1.3"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, "rope_parameters.rope_type = 'linear'"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types holds ['full_attention']"),
    ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, message):
    hf_config = dict(CONFIG, model_type="deepseek_v4", **change)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        hf.config_from_hf(json.loads(json.dumps(hf_config)))
