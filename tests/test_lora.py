"""LoRA: adapters leave the function unchanged at init, are served merged (folded at weight sync) or unmerged,
stay bitwise on-policy under the aligned policy, and are the only thing a LoRA trainer updates."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxalign as ja
from jaxalign.model.lora import add_lora, has_lora

from conftest import build_lora_model, build_model, forward_logits, random_tokens

ALIGNED = ja.NumericPolicy.preset("aligned-bf16")


def test_adapters_start_as_identity():
    model = ja.Transformer(ja.ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    tokens = random_tokens(model.config, 2, 10)
    before = np.asarray(forward_logits(model, tokens, ALIGNED)[0])
    assert add_lora(model, 4, 8.0, targets=("q_proj", "v_proj")) == 4 and has_lora(model)
    np.testing.assert_array_equal(np.asarray(forward_logits(model, tokens, ALIGNED)[0]), before)
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


@pytest.mark.full_matrix(cover="tests/test_lora.py::test_lora_trainer_on_mla_updates_only_adapters_and_stays_on_policy"
                                "[tiny-glm5-kv_b_proj]",
                         why="a LoRA run of Trainer.run (warm start, evaluation, checkpoints) on GQA: the core's "
                             "LoRA runs step the trainer on MLA and on the hybrid; Trainer.run is every RL test's")
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


# --- LoRA on multi-head latent attention -------------------------------------------------------------------------
def _mla_lora_model(preset: str, targets=None) -> ja.Transformer:
    """A fresh MLA model with rank-4 adapters (default: every attention projection) and non-zero B."""
    model = nnx.clone(build_model(preset))
    add_lora(model, 4, 8.0, targets=targets)
    rng = np.random.default_rng(0)
    for _, module in nnx.iter_graph(model):
        if getattr(module, "lora_b", None) is not None:
            module.lora_b[...] = rng.normal(0, 0.1, module.lora_b[...].shape).astype(np.float32)
    return model


def test_mla_targets_default_to_its_projections_and_bad_targets_are_refused():
    from jaxalign.model.lora import attention_targets
    glm5 = nnx.clone(build_model("tiny-glm5"))
    assert attention_targets(glm5.config) == ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
    with pytest.raises(ValueError, match=r"LoRA targets \['k_proj', 'v_proj'\] match no layer of this mla model; "
                                         r"its targets: q_a_proj, q_b_proj, kv_a_proj, kv_b_proj, o_proj, gate"):
        add_lora(glm5, 4, 8.0, targets=("q_a_proj", "k_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"\['wq_b'\] are the DSA indexer's projections"):
        add_lora(glm5, 4, 8.0, targets=("wq_b", "o_proj"))
    with pytest.raises(ValueError, match=r"unknown LoRA targets \['kv_proj'\]; allowed: q_proj, k_proj"):
        add_lora(glm5, 4, 8.0, targets=("kv_proj",))
    assert not has_lora(glm5)  # a refused call attaches nothing
    assert add_lora(glm5, 4, 8.0) == 5 * glm5.config.n_layers
    assert glm5.blocks[0].attn.indexer.wq_b.lora_a is None  # the indexer is not adapted


def test_kv_b_adapter_equals_its_merged_weight_in_both_mla_forms():
    """kv_b_proj's weight is read inside MLA (split into the key and value up-projections, absorbed into the query
    in the engine's form), not through a Linear call: its adapter must act there. In float32 the unmerged low-rank
    path equals the model with the adapter folded into the weight (within 1e-5), in both forms."""
    from jaxalign.model.lora import merge_lora_for_serving
    model = _mla_lora_model("tiny-deepseek-v3", targets=("kv_b_proj",))
    tokens = random_tokens(model.config, 2, 8)
    fp32 = ja.NumericPolicy.preset("fp32")
    folded = nnx.clone(model)
    merge_lora_for_serving(folded, fp32)
    base = np.asarray(forward_logits(build_model("tiny-deepseek-v3"), tokens, fp32)[0])
    for form in ("expanded", "absorbed"):
        reference = np.asarray(forward_logits(folded, tokens, fp32.replace(mla=form))[0])
        assert np.abs(reference - base).max() > 1e-2  # the adapter changes the function
        unmerged = np.asarray(forward_logits(model, tokens, fp32.replace(mla=form, lora="unmerged"))[0])
        np.testing.assert_allclose(unmerged, reference, rtol=0, atol=1e-5 * np.abs(reference).max())


@pytest.mark.bitwise
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_lora_knob_on_the_kv_b_adapter_changes_bf16_numbers_in_both_mla_forms(form):
    """The `lora` knob on MLA: in bf16, kv_b_proj's adapter folded into the weight (merged) and applied as its
    low-rank path (unmerged) round differently, in both forms (the bitwise half of the test above, the half
    the ISA legs rerun)."""
    model = _mla_lora_model("tiny-deepseek-v3", targets=("kv_b_proj",))
    tokens = random_tokens(model.config, 2, 8)
    bf16 = [np.asarray(forward_logits(model, tokens, ALIGNED.replace(mla=form, lora=m))[0], np.float32)
            for m in ("merged", "unmerged")]
    assert not np.array_equal(*bf16), form


@pytest.mark.bitwise
@pytest.mark.parametrize("preset, mode, form", [
    ("tiny-glm5", "unmerged", "expanded"),
    pytest.param("tiny-deepseek-v3", "merged", "absorbed", marks=pytest.mark.full_matrix(
        cover="tests/test_lora.py::test_aligned_engine_matches_trainer_with_mla_adapters"
              "[tiny-glm5-unmerged-expanded]",
        why="merged adapters in the absorbed form: the kv_b adapter's knob and merge cases in both forms"))])
def test_aligned_engine_matches_trainer_with_mla_adapters(preset, mode, form):
    """Adapters on every MLA projection: the engine (adapters folded at sync, or applied unmerged as the
    trainer applies them) reports the trainer's logprobs bit for bit."""
    model = _mla_lora_model(preset)
    policy = ALIGNED.replace(lora=mode, mla=form)
    prompts = [list(p) for p in random_tokens(model.config, 6, 5, seed=2)]
    rollout = ja.generate(model, prompts, policy, max_new_tokens=8, temperature=1.0, batch_size=4)
    lp, _ = ja.token_logprobs(model, rollout.tokens, policy)
    np.testing.assert_array_equal(np.asarray(lp)[rollout.mask], rollout.logprobs[rollout.mask])


class _ParityTask:
    """A task a random-init model earns mixed rewards on: reward 1 when the first completion token is even."""

    prompt_width = 8

    def train_items(self, step, n, seed):
        return [int(x) for x in np.random.default_rng(seed * 1000 + step).integers(3, 40, n)]

    def eval_items(self, seed):
        return [5, 7]

    def prompt(self, item):
        return [1, item, item + 1, item + 2]

    def reward(self, item, completion):
        return float(len(completion) > 0 and completion[0] % 2 == 0)

    def describe(self):
        return {"task": "parity-of-first-token"}


@pytest.mark.parametrize("preset, inner", [
    ("tiny-glm5", "kv_b_proj"),
    pytest.param("tiny-qwen3.5", "in_proj_qkv", marks=pytest.mark.full_matrix(
        cover="tests/test_lora.py::test_lora_trainer_on_mla_updates_only_adapters_and_stays_on_policy"
              "[tiny-glm5-kv_b_proj]",
        why="the same trainer on another family's adapted projection (the hybrid's fused qkv)"))])
def test_lora_trainer_on_mla_updates_only_adapters_and_stays_on_policy(preset, inner, tmp_path):
    """GRPO with adapters on every mixer projection (MLA's kv_b_proj included, read inside attention; the gated
    DeltaNet's in_proj_qkv / in_proj_z / out_proj beside gated attention's): the aligned engine reports the
    trainer's logprobs bitwise at every step (rollout KL 0), and only adapters change -- B among them, `inner`'s
    too -- in the trainer's own copy of the model."""
    from jaxalign.rl.grpo import GRPOConfig
    from jaxalign.rl.trainer import RLConfig, Trainer
    model = build_model(preset)
    cfg = RLConfig(steps=2, prompts_per_step=4, grpo=GRPOConfig(group_size=4), max_new_tokens=4, eval_problems=2,
                   lora_rank=4, learning_rate=1e-2)  # default targets: the model's own
    trainer = Trainer(model, cfg, str(tmp_path / "lora"), task=_ParityTask())
    before = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
    # two steps without evaluation or checkpoints: the second step's rollouts come from the updated adapters
    rows = [trainer.train_step() for _ in range(2)]
    assert all(r["rollout_corr/kl"] == 0.0 and r["grad_norm"] > 0 for r in rows), rows
    after = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(trainer.params)}
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all("lora" in k for k in changed)
    assert any(inner in k and "lora_b" in k for k in changed)
    assert not has_lora(model) and has_lora(trainer.model)  # adapters went into the trainer's own copy
