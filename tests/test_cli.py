"""The `jaxalign` command, run as a user runs it (a subprocess of the installed console script)."""

import json
import subprocess

import pytest

from jaxalign.numerics import FIELDS, PRESETS


def _run(*args, check=True):
    proc = subprocess.run(["jaxalign", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_policies_json_lists_every_preset_with_every_field():
    data = json.loads(_run("policies", "--json").stdout)
    assert set(data) == set(PRESETS)
    for name, fields in data.items():
        assert set(FIELDS) <= set(fields)
        assert fields["string"] == str(PRESETS[name])


def test_policies_table_and_help():
    out = _run("policies").stdout
    assert "aligned-bf16" in out and "combine_acc" in out
    assert "compare" in _run("--help").stdout
    assert "--engine-batch" in _run("compare", "--help").stdout


def test_compare_json_reports_each_batch():
    # the settings of tests/test_alignment.py's static bitwise case: the engine programs at batch 1 and 8 and the
    # scoring program are the ones it compiles (the run's persistent compilation cache has them for either)
    out = _run("compare", "--model", "small", "--trainer", "aligned-bf16", "--engine", "aligned-bf16",
               "--prompts", "32", "--max-new-tokens", "12", "--seed", "1", "--engine-batch", "1,8",
               "--json").stdout
    data = json.loads(out)
    assert [r["engine_batch"] for r in data["runs"]] == [1, 8]
    for run in data["runs"]:
        assert run["max_abs_logp_diff"] == 0.0 and run["route_flip_rate"] == 0.0 and run["k3_kl"] == 0.0
        for key in ("kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "log_ppl_abs_diff",
                    "ppl_ratio", "extreme_frac_tau2", "bitwise_equal_fraction", "route_token_any_flip"):
            assert key in run


@pytest.mark.parametrize("args, needle", [
    (("compare", "--trainer", "compute=fp8"), "compute"),
    (("compare", "--model", "huge"), "allowed: tiny"),
    (("compare", "--engine-batch", "0"), "positive ints"),
    (("localize", "--attribute", "fields,layers"), "expected one or more of fields, parts, modules"),
    (("experiment", "countdown", "--sft-answers", "habit:1.5", "--out", "unused"), "habit:P with 0 <= P <= 1"),
])
def test_bad_arguments_explain_themselves(args, needle):
    proc = _run(*args, check=False)
    assert proc.returncode != 0 and needle in proc.stderr


def test_demo_quick_runs(tmp_path):
    out = tmp_path / "demo"
    data = json.loads(_run("demo", "--quick", "--json", "--out", str(out)).stdout)
    aligned, misaligned = data["arms"]["aligned"], data["arms"]["misaligned"]
    assert aligned["mean_kl"] == 0.0 and aligned["steps_with_nonzero_kl"] == 0
    assert aligned["rejected_fraction"] == 0.0 and aligned["max_abs_logp_diff"] == 0.0
    assert misaligned["max_abs_logp_diff"] > 0 and misaligned["steps_with_nonzero_kl"] > 0
    for name in ("summary.json", "summary.md", "reward.png", "kl.png", "rejected.png"):
        assert (out / name).exists(), name
    for arm in ("aligned", "misaligned"):
        assert (out / arm / "seed0" / "metrics.jsonl").exists()


def test_usage_errors_exit_2_but_a_library_bug_keeps_its_traceback(monkeypatch, capsys):
    """jaxalign's own validation errors and UsageError are reported in one line with exit code 2; a ValueError
    raised inside another library (here NumPy) is not dressed up as a usage error: it propagates."""
    import numpy as np

    from jaxalign import cli
    from jaxalign.cli import policies

    assert cli.main(["golden", "export", "--prompts", "p.jsonl", "--out", "o.json"]) == 2
    assert "exactly one of --model PRESET or --hf DIR" in capsys.readouterr().err

    def library_bug(args):
        return np.zeros(2).reshape(3)

    monkeypatch.setattr(policies, "run", library_bug)
    with pytest.raises(ValueError, match="reshape"):
        cli.main(["policies"])
