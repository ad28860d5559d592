"""The `jaxalign` command, run as a user runs it (a subprocess of the installed console script)."""

import json
import subprocess

import numpy as np
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
    (("compare", "--model", "huge"), "or one of tiny, small"),
    (("compare", "--engine-batch", "0"), "positive ints"),
    (("localize", "--attribute", "fields,layers"), "expected one or more of fields, parts, modules"),
    (("experiment", "countdown", "--sft-answers", "habit:1.5", "--out", "unused"), "habit:P[:OP] with 0 <= P <= 1"),
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


def test_usage_errors_exit_2_but_a_library_bug_keeps_its_traceback(monkeypatch, capsys, tmp_path):
    """jaxalign's own validation errors and UsageError are reported in one line with exit code 2; a ValueError
    raised inside another library (here NumPy) is not dressed up as a usage error: it propagates."""
    import numpy as np

    from jaxalign import cli
    from jaxalign.cli import policies

    (tmp_path / "file").write_text("")
    assert cli.main(["demo", "--quick", "--out", str(tmp_path / "file")]) == 2  # a UsageError
    assert f"--out {tmp_path / 'file'}: exists and is not a directory" in capsys.readouterr().err

    def library_bug(args):
        return np.zeros(2).reshape(3)

    monkeypatch.setattr(policies, "run", library_bug)
    with pytest.raises(ValueError, match="reshape"):
        cli.main(["policies"])


# --- one grammar: every case below fails (or parses) before anything is compiled -----------------------------------

def _parser_tree(parser, path=()):
    """(command path, subparser) for every (sub)command of the `jaxalign` parser."""
    import argparse
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parser_tree(sub, (*path, name))


def test_every_option_has_help_and_shows_its_default():
    import argparse

    from jaxalign.cli import make_parser
    from jaxalign.cli.args import default_text

    options, missing = 0, []
    commands = dict(_parser_tree(make_parser()))
    for path, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            options += 1
            name = f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help is argparse.SUPPRESS:
                missing.append(f"{name}: no help")
            elif action.option_strings and action.nargs != 0 and not action.required:
                if "default" not in action.help:
                    missing.append(f"{name}: the help does not state the default")
                elif action.default not in (None, []) and default_text(action.default) not in action.help:
                    missing.append(f"{name}: the help does not show the default {default_text(action.default)!r}")
    assert options > 80 and not missing, "\n".join(missing)
    # the default shown is the one used: `compare --help` states the engine batches compare() defaults to
    assert "one run each (default: 8)" in " ".join(commands[("compare",)].format_help().split())


def test_version_is_the_package_metadata(capsys):
    from importlib import metadata

    import jaxalign
    from jaxalign import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"jaxalign {metadata.version('jaxalign')}" == f"jaxalign {jaxalign.__version__}"


@pytest.mark.parametrize("command", [("compare",), ("localize",), ("check",), ("golden", "export")])
def test_model_is_a_preset_or_a_checkpoint_directory_in_every_command(command, tmp_path, capsys):
    from jaxalign.cli import make_parser
    extra = ("--prompts-file", "p", "--out", "o") if command == ("golden", "export") else ()
    parser = make_parser()
    assert parser.parse_args([*command, "--model", str(tmp_path), *extra]).model == str(tmp_path)
    assert parser.parse_args([*command, "--model", "tiny-glm5", *extra]).model == "tiny-glm5"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*command, "--model", str(tmp_path / "absent"), *extra])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "is neither a model preset nor a directory" in err and "tiny-glm5" in err


def test_prompts_is_a_count_and_prompts_file_a_file(capsys):
    from jaxalign.cli import make_parser
    parser = make_parser()
    for command in ("compare", "localize", "check"):
        assert parser.parse_args([command, "--prompts", "4"]).prompts == 4
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--prompts", "prompts.jsonl"])
        assert "'prompts.jsonl' is not an int" in capsys.readouterr().err
    args = parser.parse_args(["golden", "export", "--model", "tiny", "--prompts-file", "p.jsonl", "--out", "o"])
    assert args.prompts_file == "p.jsonl"
    for retired in (["golden", "export", "--model", "tiny", "--prompts", "p.jsonl", "--out", "o"],
                    ["golden", "export", "--hf", "DIR", "--prompts-file", "p.jsonl", "--out", "o"],
                    ["experiment", "countdown", "--arms", "aligned", "--out", "o"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(retired)
        assert exit_.value.code == 2


def _hf_dir(tmp_path, config_text=None, weights=None):
    """A transformers checkpoint directory of tiny-qwen3-moe's config, with the given config.json text and
    model.safetensors bytes."""
    from jaxalign.interop import hf
    from jaxalign.model.config import ModelConfig
    path = tmp_path / "ckpt"
    path.mkdir(parents=True)
    config = json.dumps(hf.config_to_hf(ModelConfig.preset("tiny-qwen3-moe")))
    (path / "config.json").write_text(config if config_text is None else config_text)
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    return path


def _fails_naming(capsys, argv, path):
    from jaxalign import cli
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_a_garbled_config_or_truncated_weights_exit_2_naming_the_file(tmp_path, capsys):
    from safetensors.numpy import save_file
    ckpt = _hf_dir(tmp_path / "garbled", config_text='{"model_type": "qwen3_moe", ')
    err = _fails_naming(capsys, ["check", "--model", str(ckpt), "--no-progress"], ckpt / "config.json")
    assert "not valid JSON" in err
    save_file({"model.embed_tokens.weight": np.ones((64, 32), np.float32)}, str(tmp_path / "w.safetensors"))
    weights = (tmp_path / "w.safetensors").read_bytes()
    ckpt = _hf_dir(tmp_path / "truncated", weights=weights[:-100])
    err = _fails_naming(capsys, ["check", "--model", str(ckpt), "--no-progress"], ckpt / "model.safetensors")
    assert "not a readable safetensors file" in err
    _fails_naming(capsys, ["import-hf", str(ckpt), "--out", str(tmp_path / "out")], ckpt / "model.safetensors")


def test_hf_load_names_a_bad_file_for_library_users(tmp_path):
    from jaxalign.interop import hf
    ckpt = _hf_dir(tmp_path, config_text="[1, 2")
    with pytest.raises(ValueError, match=f"{ckpt / 'config.json'}: the transformers config is not valid JSON"):
        hf.load(str(ckpt))
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        hf.load(str(ckpt))


def test_golden_check_on_a_missing_or_garbled_file_exits_2_naming_it(tmp_path, capsys):
    golden, candidate = tmp_path / "golden.json", tmp_path / "cand.jsonl"
    err = _fails_naming(capsys, ["golden", "check", "--golden", str(golden), "--candidate", str(candidate)],
                        golden)
    assert "cannot read the golden file (No such file or directory)" in err
    golden.write_text('{"format": "jaxalign-golden-v1", "sequences": [')
    _fails_naming(capsys, ["golden", "check", "--golden", str(golden), "--candidate", str(candidate)], golden)
    golden.write_text('{"format": "jaxalign-golden-v1", "policy": "fp32", "sequences": []}')
    _fails_naming(capsys, ["golden", "check", "--golden", str(golden), "--candidate", str(candidate)], candidate)
    _fails_naming(capsys, ["golden", "export", "--model", "tiny", "--prompts-file", str(candidate), "--out",
                           str(tmp_path / "out.json")], candidate)
    candidate.write_text("1 2 3\n")
    err = _fails_naming(capsys, ["golden", "export", "--model", "tiny", "--prompts-file", str(candidate), "--out",
                                 str(tmp_path / "absent" / "out.json")], tmp_path / "absent" / "out.json")
    assert "its directory does not exist" in err


def test_experiment_out_naming_a_file_or_an_unwritable_place_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    base = ["experiment", "countdown", "--steps", "1", "--sft-steps", "0"]
    err = _fails_naming(capsys, [*base, "--out", str(tmp_path / "file")], tmp_path / "file")
    assert "exists and is not a directory" in err
    err = _fails_naming(capsys, [*base, "--out", str(tmp_path / "file" / "run")], tmp_path / "file" / "run")
    assert "cannot create the directory" in err
