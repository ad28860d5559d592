"""`jaxalign check`: exit 0 for a pair that claims alignment and holds it, 1 for a pair with a gap above the
threshold, 2 (before the model loads) for a policy the backend cannot run. Small settings: tiny model, engine
batch 4, probe batches 1 and 3; the two passing pairs take the gap settings of the bitwise engine tests whose
programs they share (tests/test_alignment.py, tests/test_mla.py).

The failing pair is the README's typical `train-bf16` trainer and `serve-bf16` engine: its k3 (~3e-4 here) is under
the seed's 1e-3 "equivalent" threshold, but it flips router decisions, which `check` does not accept by default
(docs/check.md)."""

import json

import jax
import pytest

from jaxalign import cli

SMALL = ["--model", "tiny", "--engine-batch", "4", "--probe-batch", "1,3", "--max-new-tokens", "4",
         "--no-progress"]


def _run(capsys, *args):
    code = cli.main(["check", *SMALL, *args])
    return code, capsys.readouterr()


def test_aligned_pair_passes(capsys):
    # the gap settings of tests/test_alignment.py's bitwise cases (`small`, 32 prompts, 12 new tokens, seed 1, batch
    # 8: static, continuous and chunked by 4): a run compiles those engine and scoring programs once for both
    code, out = _run(capsys, "--trainer", "aligned-bf16", "--engine", "aligned-bf16", "--model", "small",
                     "--engine-batch", "8", "--prompts", "32", "--max-new-tokens", "12", "--seed", "1")
    assert code == 0, out.out
    assert f"backend {jax.default_backend()}" in out.out and "CPU ISA" in out.out and "claims alignment: True" in out.out
    assert out.out.rstrip().endswith("PASS") and "FAIL" not in out.out
    # the implementation each kernel ran with is named (numerics/kernels.py): tiled:8 is lax on the CPU, the
    # Pallas kernels with derived blocks on a GPU/TPU
    expected = ("lax-tiled T=8 (cpu)" if jax.default_backend() == "cpu" else "pallas ")
    for kernel in ("matmul", "grouped_matmul"):
        assert f"trainer: {kernel}: {expected}" in out.out, out.out
    assert "trainer: attention: lax-full" in out.out


def test_pair_with_a_gap_fails_with_documented_json(capsys):
    code, out = _run(capsys, "--trainer", "train-bf16", "--engine", "serve-bf16", "--prompts", "8",
                     "--max-new-tokens", "8", "--json")
    assert code == 1
    result = json.loads(out.out)
    assert set(result) == {"environment", "model", "trainer", "engine", "claims_alignment", "replay", "thresholds",
                           "kernels", "audit", "probes", "kernel_gaps", "gaps", "passed"}  # docs/check.md
    # train-bf16 multiplies with XLA's kernel, sorted dispatch; serve-bf16 with chunked attention, dense dispatch
    backend = "gpu" if jax.default_backend() in ("cuda", "rocm") else jax.default_backend()
    assert {"matmul: xla", "grouped_matmul: xla", "attention: lax-full"} == \
        {i.replace(f" ({backend})", "") for i in result["kernels"]["trainer"]}
    assert "attention: lax-chunked" in {i.replace(f" ({backend})", "") for i in result["kernels"]["engine"]}
    assert next(p for p in result["probes"] if p["kernel"] == "matmul")["implementation"] == f"matmul: xla ({backend})"
    assert set(result["environment"]) == {"backend", "device_kind", "device_count", "jax", "jaxlib", "cpu_isa",
                                          "xla_flags"}
    assert result["passed"] is False and result["claims_alignment"] is False
    assert all(a["passed"] for a in result["audit"].values())  # precision is explicit on both sides ...
    assert [g["run"] for g in result["gaps"]] == ["static batch 4", "continuous 4 slots", "chunked prefill (4) batch 4"]
    # ... the failure is the gap: k3 under the threshold, but router decisions flipped
    assert all(g["k3_kl"] <= 1e-3 for g in result["gaps"])
    assert any(g["status"] == "FAIL" and g["route_flip_rate"] > 0 for g in result["gaps"])
    assert all((g["status"] == "FAIL") == (g["route_flip_rate"] > 0) for g in result["gaps"])
    assert {p["kernel"] for p in result["probes"]} == {"matmul", "rms_norm", "softmax", "attention"}
    assert all(p["status"] == "info" for p in result["probes"])  # neither policy claims batch invariance
    # the same rows through each side's kernel: serve-bf16's chunked attention is not train-bf16's full one
    gaps = {g["kernel"]: g for g in result["kernel_gaps"]}
    assert set(gaps) == {"matmul", "rms_norm", "softmax", "attention"}
    assert not gaps["attention"]["bitwise_equal"] and gaps["attention"]["max_abs_diff"] > 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TF32 is refused only on XLA:CPU")
def test_policy_the_backend_cannot_run_is_refused_first(capsys, tmp_path):
    # --model names a directory that is no checkpoint: loading it would fail, so the policy is refused first
    code, out = _run(capsys, "--engine", "fp32-tf32", "--model", str(tmp_path))
    assert code == 2
    assert "--engine: NumericPolicy.matmul_acc = 'TF32_TF32_F32'" in out.err and "allowed on cpu" in out.err


def test_glm5_aligned_pair_passes_with_latent_attention_and_indexer_probes(capsys):
    """tiny-glm5 (MLA + DSA indexer): the attention probes are the model's own (`mla_attention` over the keys
    the indexer selects, and the indexer's scores), and the gaps count index flips. The gap settings are
    tests/test_mla.py's DSA case's (32 prompts, 6 new tokens, seed 1, engine batch 8), so a run compiles those
    engine and scoring programs once for both."""
    code, out = _run(capsys, "--model", "tiny-glm5", "--trainer", "aligned-bf16", "--engine", "aligned-bf16",
                     "--engine-batch", "8", "--prompts", "32", "--max-new-tokens", "6", "--seed", "1", "--json")
    assert code == 0, out.out
    result = json.loads(out.out)
    assert result["model"]["family"] == "glm_moe_dsa" and result["passed"] and result["claims_alignment"]
    assert result["model"]["layer_kinds"] == ["dsa"] * 3
    assert result["model"]["forms"] == {"trainer": {"dsa": "expanded"}, "engine": {"dsa": "expanded"}}
    assert [p["kernel"] for p in result["probes"]] == ["matmul", "rms_norm", "softmax", "mla_attention",
                                                       "index_scores"]
    assert all(p["status"] == "pass" and p["bitwise_invariant"] for p in result["probes"])
    assert all(g["index_flip_rate"] == 0.0 and g["bitwise_equal_fraction"] == 1.0 for g in result["gaps"])


def test_latent_attention_probe_follows_the_mla_form():
    """The MLA probe runs the policy's form: expanded and absorbed give different bits on the same rows."""
    import numpy as np

    from jaxalign.check import _kernels
    from jaxalign.model.config import ModelConfig
    from jaxalign.numerics import NumericPolicy
    cfg = ModelConfig.preset("tiny-glm5")
    outs = {}
    for form in ("expanded", "absorbed"):
        make, fn = _kernels(cfg, NumericPolicy.preset("aligned-bf16").replace(mla=form))["mla_attention"]
        outs[form] = np.asarray(jax.jit(fn)(make(2, 0)), np.float32)
    assert not np.array_equal(outs["expanded"], outs["absorbed"])


def test_fp8_policies_are_probed():
    """An FP8 side adds the block-scaled product to the batch-invariance probes (bitwise under aligned-fp8's
    tiled kernel, whose claim `check` judges) and checks this backend's e4m3 rounding against ml_dtypes."""
    from jaxalign.check import _kernels, batch_invariant, probe
    from jaxalign.model.config import ModelConfig
    from jaxalign.numerics import NumericPolicy, fp8

    cfg = ModelConfig.preset("tiny")
    aligned = NumericPolicy.preset("aligned-fp8")
    assert "fp8_matmul" in _kernels(cfg, aligned) and "fp8_matmul" not in _kernels(cfg, NumericPolicy())
    assert batch_invariant(aligned)
    result = probe(cfg, aligned, "fp8_matmul", batches=(1, 3, 8, 13))
    assert result["bitwise_invariant"] and result["cases"] == 10
    rounding = fp8.rounding_check()
    assert rounding["passed"] and rounding["mismatches"] == 0 and rounding["cases"] > 700
