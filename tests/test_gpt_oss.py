"""gpt-oss (`gpt_oss`) against transformers 5.24's `GptOssForCausalLM`: a held-out checkpoint (random weights, its
sinks, biases and norms perturbed so each matters) loads through the project's loader and gives transformers' fp32
logits over 96 tokens, full forward and cached decode, with a sliding window shorter than the sequence; YaRN's
frequencies, the bitwise export, MXFP4 experts decoded exactly as transformers dequantises them, and bad configs
refused by name. The engine's side (aligned-bf16 bitwise) is tests/test_sink_attention.py."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxalign as ja  # noqa: E402
from jaxalign.interop import hf  # noqa: E402
from jaxalign.loading import load_model  # noqa: E402
from jaxalign.model.rope_scaling import Yarn  # noqa: E402
from jaxalign.numerics.lowbit import mxfp4_from_blocks, quantize_mxfp4  # noqa: E402

from conftest import forward_logits  # noqa: E402
from hf_checkpoints import (checkpoint, export_round_trip, our_cached_logits, reference_logits, token_ids,  # noqa: E402
                            transformers_cached_logits)

pytestmark = pytest.mark.hf
FP32 = ja.NumericPolicy.preset("fp32")
# Held out (no other test uses it): three layers sliding / full / sliding with a 12-position window, 4 query heads
# over 2 kv heads of 16, top-3 of 8 experts, hidden and expert sizes multiples of 32 (MXFP4 blocks), and a YaRN
# other than the released one (factor 4 over 32 positions, truncated range, beta_fast 16) so it bends the
# frequencies inside 96 positions. The released config's YaRN is checked on its own below and runs in tiny-gpt-oss.
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 16.0, "beta_slow": 1.0, "truncate": True}
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3, sliding_window=12,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=128,
              initializer_range=0.1, rope_parameters=YARN)
SEQ = 96


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers on one thread for this module's tiny model: its decode loop of 88 steps took 47 s on a busy
    2-core host with torch's default threads and 1.3 s on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturbed(model):
    """Sinks of logit scale (~1), and biases and norms away from their init (zeros / ones)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name:
                p.copy_(torch.randn_like(p))
            elif "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    torch.manual_seed(0)
    return checkpoint(_perturbed(transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG))), tmp_path_factory,
                      "gpt_oss")


def _tokens(batch=2, seq=SEQ, seed=0):
    return token_ids(CONFIG["vocab_size"], batch, seq, seed)


_reference = reference_logits


def test_fp32_logits_match_transformers_in_every_form(gpt_oss):
    """The project's loader reads the checkpoint as the sink kinds with their window, YaRN and biases; fp32
    logits over 96 tokens (the window 12 masks most keys) within 1e-4 of transformers, under full attention with
    the sink seeding the softmax and under chunked attention with the sink merged in after (the other two
    pairings run in the full matrix)."""
    model, path = gpt_oss
    ours = load_model(path)
    cfg = ours.config
    assert cfg.family == "gpt_oss" and cfg.router == "topk_softmax" and cfg.sliding_window == 12 < SEQ
    assert cfg.layer_kinds == ("sliding_sink_attention", "sink_attention", "sliding_sink_attention")
    assert cfg.rope_yarn == Yarn(factor=4.0, beta_fast=16.0, original_max_position=32, truncate=True)
    assert cfg.qkv_bias and cfg.router_bias and cfg.expert_bias and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    sinks = np.asarray(ours.blocks[0].attn.sinks[...])
    assert np.abs(sinks).min() > 0 and np.abs(sinks).max() > 0.5
    tokens = _tokens()
    ref = _reference(model, tokens)
    assert np.abs(ref).max() > 1.0
    for form in ("fp32", "fp32,attn=chunked:16,sink=merge"):
        logits = np.asarray(forward_logits(ours, tokens, ja.NumericPolicy.parse(form))[0])
        assert np.abs(logits - ref).max() <= 1e-4, form


@pytest.mark.full_matrix(cover="tests/test_gpt_oss.py::test_fp32_logits_match_transformers_in_every_form",
                         why="the other two pairings of the attention form and the sink's placement")
@pytest.mark.parametrize("form", ["fp32,sink=merge", "fp32,attn=chunked:16"])
def test_fp32_logits_match_transformers_in_the_mixed_forms(gpt_oss, form):
    model, path = gpt_oss
    tokens = _tokens()
    logits = np.asarray(forward_logits(load_model(path), tokens, ja.NumericPolicy.parse(form))[0])
    assert np.abs(logits - _reference(model, tokens)).max() <= 1e-4


def test_cached_decode_matches_transformers_both_ways(gpt_oss):
    """transformers' decode from its cache (a prefill of 8, then one token at a time to 96) gives our teacher-forced
    fp32 logits within 1e-4; our decode from the engine's state (the kinds' KV cache, one token at a time from the
    first) gives transformers' teacher-forced logits within 1e-4."""
    model, path = gpt_oss
    ours = hf.load(path)
    tokens = _tokens(seed=1)
    prefill = 8
    theirs_cached = transformers_cached_logits(model, tokens, prefill)
    ours_full = np.asarray(forward_logits(ours, tokens, FP32)[0])
    assert np.abs(theirs_cached - ours_full[:, prefill - 1:-1]).max() <= 1e-4

    ours_cached = our_cached_logits(ours, tokens, FP32, SEQ)
    assert np.abs(ours_cached - _reference(model, tokens)).max() <= 1e-4


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},  # the released gpt-oss config
    YARN,
], ids=["released", "held-out"])
def test_yarn_frequencies_and_factor_equal_transformers_bitwise(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.GptOssConfig(**{**CONFIG, "rope_parameters": rope})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    yarn = Yarn.from_hf(rope)
    ours = yarn.inv_freq(rope["rope_theta"], CONFIG["head_dim"])
    np.testing.assert_array_equal(ours.view(np.uint32), inv_freq.numpy().view(np.uint32))
    assert yarn.attention_factor == factor


def test_export_is_bitwise_and_loads_back_in_transformers(gpt_oss, tmp_path):
    """hf.save writes the checkpoint's own tensors bit for bit (interleaved gate/up, fused experts, router and
    sinks) and a config transformers reads to the same logits; reading it back gives the same parameters."""
    from flax import nnx
    model, path = gpt_oss
    out = str(tmp_path / "export")
    ours, theirs, written = export_round_trip(path, out)
    for name in theirs:
        np.testing.assert_array_equal(written[name].view(np.uint32), theirs[name].view(np.uint32), err_msg=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GptOssForCausalLM" and loaded.config.layer_types == CONFIG["layer_types"]
    tokens = _tokens(seed=2)
    assert np.abs(_reference(loaded, tokens) - _reference(model, tokens)).max() == 0.0
    again = hf.load(out)
    assert again.config == ours.config
    a, b = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (ours, again))
    import jax
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


def test_mxfp4_export_is_refused_where_checkpoints_have_none(tmp_path):
    """`save(..., experts=...)`: a format other than float / mxfp4, or MXFP4 experts for a family whose checkpoints
    carry none, is refused by name before anything is written."""
    from conftest import build_model
    tiny = build_model("tiny")
    with pytest.raises(ValueError, match="experts = 'int4'; allowed: float, mxfp4"):
        hf.save(tiny, str(tmp_path / "a"), experts="int4")
    with pytest.raises(ValueError, match="experts = 'mxfp4' export is not supported for qwen3_moe"):
        hf.save(tiny, str(tmp_path / "b"), experts="mxfp4")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _torch_dequantised(blocks, scales):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()


def test_mxfp4_decode_equals_transformers_dequantisation_bitwise():
    """Every byte of codes (both nibbles) under every scale byte whose values are normal float32 numbers: our
    MXFP4 format's values equal transformers' `convert_moe_packed_tensors` (float32) bit for bit, layout included
    ([E, N, G, 16] blocks -> [E, K, N]). Where they differ, by design (numerics/lowbit.py): XLA:CPU flushes float32
    subnormals, so a scale byte of 0 (2^-127, itself subnormal) decodes every value as 0 and under byte 1 the
    values below 2^-126 are 0 (transformers keeps them); 0xFF is the OCP spec's NaN scale (transformers' ldexp
    gives code * 2^128: +-inf, +-2^127, or 0). No real checkpoint has those bytes."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)
    blocks[0, 0, 0] = np.arange(0, 256, 16, dtype=np.uint8) + np.arange(16, dtype=np.uint8)  # every nibble pair
    scales = rng.integers(2, 255, (3, 40, 2), dtype=np.uint8)
    scales[0, :, 0] = np.arange(2, 42)
    scales[1, :, 1] = np.arange(214, 254)
    ours = np.asarray(mxfp4_from_blocks(blocks, scales).dequantized())
    np.testing.assert_array_equal(ours.view(np.uint32), _torch_dequantised(blocks, scales).view(np.uint32))
    edge = np.array([[[0], [1], [255]]], np.uint8)  # [1, 3 rows, 1 block]: scale bytes 0, 1 and 0xFF
    edge_blocks = blocks[:1, :3, :1]
    ours, theirs = np.asarray(mxfp4_from_blocks(edge_blocks, edge).dequantized()), _torch_dequantised(edge_blocks, edge)
    assert np.all(ours[..., 0] == 0) and np.any(theirs[..., 0] != 0)
    normal = np.abs(theirs[..., 1]) >= 2.0 ** -126
    assert np.array_equal(ours[..., 1][normal], theirs[..., 1][normal]) and np.all(ours[..., 1][~normal] == 0)
    assert np.all(np.isnan(ours[..., 2])) and not np.any(np.isnan(theirs[..., 2]))


def test_mxfp4_checkpoint_loads_its_exact_values(gpt_oss, tmp_path):
    """An MXFP4 checkpoint (the released layout: uint8 *_blocks / *_scales for the experts, quantization_config
    mxfp4): its experts load as exactly the values transformers dequantises them to, the model gives the logits of
    transformers holding those values, re-quantising the masters (what an aligned-mxfp4 engine does at a sync)
    gives them back bit for bit, and so does an MXFP4 export."""
    import jax
    from safetensors.numpy import load_file, save_file
    model, path = gpt_oss
    tensors = load_file(os.path.join(path, "model.safetensors"))
    rng = np.random.default_rng(3)
    e, h, i = 8, 64, 32
    decoded = {}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(120, 126, (e, rows, cols // 32), dtype=np.uint8)
            del tensors[p + proj]
            tensors[p + proj + "_blocks"], tensors[p + proj + "_scales"] = blocks, scales
            decoded[p + proj] = _torch_dequantised(blocks, scales)  # [E, in, out], transformers' layout
    quantised = tmp_path / "mxfp4"
    quantised.mkdir()
    save_file(tensors, str(quantised / "model.safetensors"))
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantised / "config.json").write_text(json.dumps(config))
    ours = hf.load(str(quantised))
    requantised = jax.jit(lambda w: quantize_mxfp4(w).dequantized())
    for layer, block in enumerate(ours.blocks):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = decoded[p + "gate_up_proj"], decoded[p + "down_proj"]
        np.testing.assert_array_equal(np.asarray(block.mlp.w_gate[...]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(block.mlp.w_up[...]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(block.mlp.w_down[...]), down)
        for master in (block.mlp.w_gate, block.mlp.w_up, block.mlp.w_down):
            again = np.asarray(requantised(master[...]))
            np.testing.assert_array_equal(again.view(np.uint32), np.asarray(master[...]).view(np.uint32))
    # exported back in MXFP4 (`save(..., experts="mxfp4")`): transformers dequantises the written blocks to the
    # checkpoint's values bit for bit, and the export loads back to the same masters
    exported = tmp_path / "mxfp4-export"
    hf.save(ours, str(exported), experts="mxfp4")
    written = load_file(str(exported / "model.safetensors"))
    assert json.load(open(exported / "config.json"))["quantization_config"]["quant_method"] == "mxfp4"
    for name, values in decoded.items():
        assert name not in written and written[name + "_blocks"].dtype == np.uint8
        again = _torch_dequantised(written[name + "_blocks"], written[name + "_scales"])
        np.testing.assert_array_equal(again.view(np.uint32), values.view(np.uint32))
    reloaded = hf.load(str(exported))
    for block, back in zip(ours.blocks, reloaded.blocks):
        for name in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"):
            np.testing.assert_array_equal(np.asarray(getattr(back.mlp, name)[...]),
                                          np.asarray(getattr(block.mlp, name)[...]))
    with torch.no_grad():
        for layer, mod in enumerate(model.model.layers):
            p = f"model.layers.{layer}.mlp.experts."
            mod.mlp.experts.gate_up_proj.copy_(torch.from_numpy(decoded[p + "gate_up_proj"]))
            mod.mlp.experts.down_proj.copy_(torch.from_numpy(decoded[p + "down_proj"]))
    tokens = _tokens(seed=4)
    ref = _reference(model, tokens)
    assert np.abs(np.asarray(forward_logits(ours, tokens, FP32)[0]) - ref).max() <= 1e-4
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(quantised / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj_blocks but no model.layers.1.mlp.experts.down_proj_scales"):
        hf.load(str(quantised))


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={**YARN, "rope_type": "llama3"}),
     r"rope_parameters.rope_type = 'llama3' \(a RoPE scaling\) is not supported; supported: default, yarn"),
    (dict(rope_parameters={**YARN, "mscale": 0.7}), r"rope_parameters.mscale = 0.7 is not supported with rope_type"),
    (dict(quantization_config={"quant_method": "fp8"}),
     r"quantization_config.quant_method = 'fp8' is not supported for gpt_oss; supported: mxfp4"),
    (dict(head_dim=None), r"no value for head_dim \(required for model_type 'gpt_oss'"),
    (dict(sliding_window=None), r"no value for sliding_window \(required for model_type 'gpt_oss'"),
    (dict(layer_types=["sliding_attention", "linear_attention", "full_attention"]),
     r"layer_types holds \['linear_attention'\]; supported: only 'sliding_attention', 'full_attention'"),
])
def test_unsupported_or_incomplete_configs_are_refused_by_name(tmp_path, changes, message):
    base = transformers.GptOssConfig(**CONFIG).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**base, **changes}))
    with pytest.raises(ValueError, match=message):
        hf.load(str(tmp_path))


@pytest.mark.parametrize("missing", ["num_local_experts", "intermediate_size"])
def test_a_config_missing_a_needed_field_exits_2_naming_it(tmp_path, capsys, missing):
    from jaxalign import cli
    config = transformers.GptOssConfig(**CONFIG).to_dict()
    del config[missing]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["import-hf", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and missing in err and "Traceback" not in err, err
