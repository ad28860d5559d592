"""LoRA: adapters leave the function unchanged at init, are served merged (folded at weight sync) or unmerged,
stay bitwise on-policy under the aligned policy, and are the only thing a LoRA trainer updates."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxalign as ja
from jaxalign.model.lora import add_lora, has_lora

from conftest import build_lora_model, build_model, random_tokens

ALIGNED = ja.NumericPolicy.preset("aligned-bf16")


def test_adapters_start_as_identity():
    model = ja.Transformer(ja.ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    tokens = random_tokens(model.config, 2, 10)
    before = np.asarray(model(tokens, policy=ALIGNED)[0])
    assert add_lora(model, 4, 8.0, targets=("q_proj", "v_proj")) == 4 and has_lora(model)
    np.testing.assert_array_equal(np.asarray(model(tokens, policy=ALIGNED)[0]), before)
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        add_lora(model, 4, 8.0, targets=("experts",))
    with pytest.raises(ValueError, match="rank"):
        add_lora(model, 0, 8.0)


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_aligned_engine_matches_trainer_with_adapters(mode):
    model = build_lora_model()
    policy = ALIGNED.replace(lora=mode)
    prompts = [list(p) for p in random_tokens(model.config, 6, 5, seed=2)]
    rollout = ja.generate(model, prompts, policy, max_new_tokens=8, temperature=1.0, batch_size=4)
    lp, _ = ja.token_logprobs(model, rollout.tokens, policy)
    np.testing.assert_array_equal(np.asarray(lp)[rollout.mask], rollout.logprobs[rollout.mask])


def test_merged_engine_folds_adapters_at_sync():
    model = build_lora_model()
    engine = ja.Engine(model, ALIGNED)
    q = engine.state["blocks"][0]["attn"]["q_proj"]
    assert not np.any(np.asarray(q["lora_b"][...]))  # B zeroed: no adapter work per step
    assert not np.array_equal(np.asarray(q["w"][...], np.float32),
                              np.asarray(model.blocks[0].attn.q_proj.w[...].astype(np.float32)))
    unmerged = ja.Engine(model, ALIGNED.replace(lora="unmerged"))
    assert np.any(np.asarray(unmerged.state["blocks"][0]["attn"]["q_proj"]["lora_b"][...]))
    assert np.any(np.asarray(model.blocks[0].attn.q_proj.lora_b[...]))  # the trainer's model is untouched


def test_lora_trainer_updates_only_adapters(tmp_path):
    from jaxalign.rl.grpo import GRPOConfig
    from jaxalign.rl.sft import SFTConfig, warm_start
    from jaxalign.rl.trainer import RLConfig, Trainer
    # a warm start earns mixed rewards, so group advantages (and gradients) are non-zero
    model = warm_start(ja.ModelConfig.preset("countdown"), SFTConfig(problems=300, steps=30), str(tmp_path),
                       progress=False)
    cfg = RLConfig(steps=2, prompts_per_step=8, grpo=GRPOConfig(group_size=4), max_new_tokens=20,
                   eval_problems=4, lora_rank=4, learning_rate=1e-2)
    trainer = Trainer(model, cfg, str(tmp_path / "lora"))
    before = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
    rows = trainer.run(progress=False)
    assert all(r["rollout_corr/kl"] == 0.0 for r in rows if r["step"] > 0)
    after = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all("lora" in k for k in changed)
    assert any("lora_b" in k for k in changed)
    from jaxalign.model.lora import has_lora
    assert not has_lora(model) and has_lora(trainer.model)  # adapters went into the trainer's own copy
