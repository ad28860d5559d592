"""ModelConfig presets and validation."""

import pytest

from jaxalign import ModelConfig
from jaxalign.model.config import preset_names


def test_required_presets():
    for name in ("tiny", "small", "bench", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe",
                 "tiny-glm4-moe"):
        assert name in preset_names()
        cfg = ModelConfig.preset(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    bench = ModelConfig.preset("bench")
    assert (bench.d_model, bench.n_layers, bench.n_experts, bench.top_k, bench.expert_dim, bench.vocab_size) == \
        (256, 4, 16, 4, 64, 256)


def test_fingerprint_tracks_architecture():
    tiny = ModelConfig.preset("tiny")
    assert tiny.fingerprint() == ModelConfig.preset("tiny").fingerprint()
    assert tiny.fingerprint() != tiny.replace(top_k=2).fingerprint()


@pytest.mark.parametrize("change, needle", [
    (dict(top_k=9), "top_k = 9 exceeds n_experts"),
    (dict(n_kv_heads=3), "not divisible by n_kv_heads"),
    (dict(router="sigmoid_grouped", n_groups=3), "n_groups = 3 does not divide"),
    (dict(router="sigmoid_grouped", n_groups=4, topk_groups=5), "topk_groups"),
    (dict(router="sigmoid_grouped", n_groups=4, topk_groups=1, top_k=3), "selectable"),
    (dict(router="argmax"), "router"),
    (dict(qk_norm="layer"), "qk_norm"),
    (dict(d_model=0), "d_model"),
    (dict(head_dim=7), "even"),
    (dict(first_k_dense=2), "no MoE layer"),
    (dict(shared_expert_gate=True), "shared_expert_dim"),
])
def test_impossible_configs_raise(change, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.preset("tiny").replace(**change)


def test_unknown_preset():
    with pytest.raises(ValueError, match="allowed: tiny"):
        ModelConfig.preset("huge")


def test_public_api_by_role():
    """`import jaxalign` is enough for every role: core, engine, scoring, analysis, and the interop subpackage."""
    import jaxalign as ja

    for name in ("NumericPolicy", "PRESETS", "PolicySchedule", "ModelConfig", "Transformer", "RoutingRecord",
                 "make_mesh", "Engine", "generate", "Rollout", "SamplingParams", "token_logprobs", "sequence_logprobs",
                 "mismatch_metrics", "routing_metrics", "compare", "localize"):
        assert name in ja.__all__ and (callable(getattr(ja, name)) or isinstance(getattr(ja, name), dict)), name
    assert callable(ja.interop.hf.load) and callable(ja.interop.golden.export_golden)
def test_mla_config_is_checked_and_gqa_fingerprints_do_not_see_it():
    from jaxalign import ModelConfig
    import pytest
    cfg = ModelConfig.preset("tiny-deepseek-v3")
    assert cfg.rotary_dim == cfg.qk_rope_head_dim and "kv_lora_rank" in cfg.to_dict()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert "kv_lora_rank" not in ModelConfig.preset("tiny").to_dict()
    with pytest.raises(ValueError, match="head_dim = 12; under attention_kind='mla'"):
        cfg.replace(head_dim=12)
    with pytest.raises(ValueError, match="n_kv_heads = 2; under attention_kind='mla'"):
        cfg.replace(n_kv_heads=2)
    with pytest.raises(ValueError, match="kv_lora_rank = 0"):
        cfg.replace(kv_lora_rank=0)
    with pytest.raises(ValueError, match="attention_kind = 'sparse'; allowed: gqa, mla"):
        cfg.replace(attention_kind="sparse")
