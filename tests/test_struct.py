"""One definition of each mode and default: replay modes, correction modes, policies held as values by the RL
configs and arms, and the CLI's shared argument groups taking their defaults from where the behaviour lives."""

import dataclasses

import pytest

from jaxalign import cli
from jaxalign.cli import experiment as cli_experiment
from jaxalign.align.compare import compare, score_rollout
from jaxalign.align.localize import localize
from jaxalign.check import run_check
from jaxalign.cli.args import field_default, param_default
from jaxalign.model.config import ModelConfig
from jaxalign.numerics import PRESETS, NumericPolicy
from jaxalign.replay_modes import ENGINE_REPLAY_MODES, REPLAY_MODES, check_replay
from jaxalign.rl.arms import Arm, parse_arm
from jaxalign.rl.correction import MODES
from jaxalign.rl.experiment import ExperimentConfig, experiment_record
from jaxalign.rl.sft import SFTConfig, cache_key
from jaxalign.rl.trainer import RLConfig


def _choices(parser, *command):
    sub = parser
    for name in command:
        sub = next(a for a in sub._actions if a.dest in ("command", "experiment")).choices[name]
    return {a.dest: a for a in sub._actions}


def test_replay_modes_are_defined_once():
    assert REPLAY_MODES == ("none", "r2", "r3", "r3w", "index", "r3+index", "r3w+index")
    assert ENGINE_REPLAY_MODES == ("none", "r3")
    parser = cli.make_parser()
    assert tuple(_choices(parser, "compare")["replay"].choices) == REPLAY_MODES
    assert tuple(_choices(parser, "check")["replay"].choices) == REPLAY_MODES
    assert tuple(_choices(parser, "localize")["replay"].choices) == ENGINE_REPLAY_MODES
    with pytest.raises(ValueError, match=r"replay = 'r4'; allowed: none, r2, r3, r3w, index, r3\+index, r3w\+index"):
        check_replay("r4")
    with pytest.raises(ValueError, match=r"replay = 'r2'; allowed: none, r3"):
        check_replay("r2", ENGINE_REPLAY_MODES)
    with pytest.raises(ValueError, match=r"replay = 'r4'; allowed: none, r2, r3, r3w, index"):
        score_rollout(None, None, NumericPolicy(), replay="r4")  # refused before anything runs
    with pytest.raises(ValueError, match=r"replay = 'r4'"):
        RLConfig(replay="r4")
    for mode in REPLAY_MODES:
        assert RLConfig(replay=mode).replay == mode and parse_arm(f"x=fp32/fp32;replay={mode}").replay == mode
    assert RLConfig(mode=MODES[1]).mode == "bypass"


def test_rl_configs_and_arms_hold_policies_and_write_text():
    cfg = RLConfig(trainer_policy="aligned-bf16,kernel=xla", engine_policy=NumericPolicy.preset("serve-bf16"))
    assert cfg.trainer_policy == NumericPolicy.parse("aligned-bf16,kernel=xla")
    assert cfg.engine_policy is NumericPolicy.preset("serve-bf16")
    assert RLConfig().trainer_policy == NumericPolicy.preset("aligned-bf16")
    d = cfg.to_dict()
    assert (d["trainer_policy"], d["engine_policy"]) == ("aligned-bf16,kernel=xla", "serve-bf16")
    assert d["grpo"] == dataclasses.asdict(cfg.grpo) and isinstance(d["correction"], dict)
    with pytest.raises(ValueError, match="trainer_policy: unknown policy key 'warp'"):
        RLConfig(trainer_policy="warp=9")

    arm = parse_arm("x=aligned-bf16,kernel=xla/serve-bf16;replay=r3")
    assert isinstance(arm.trainer, NumericPolicy) and arm.engine == NumericPolicy.preset("serve-bf16")
    assert arm.spec() == "x=aligned-bf16,kernel=xla/serve-bf16;replay=r3"
    assert parse_arm("aligned").spec() == "aligned"  # a built-in arm writes its name
    assert Arm("aligned", "train-bf16", "serve-bf16").spec() == "aligned=train-bf16/serve-bf16"  # not the built-in

    exp = ExperimentConfig(arms=("aligned", "x=fp32/fp16,dispatch=sorted;correction=none"))
    assert all(isinstance(a, Arm) for a in exp.arms) and exp.parsed_arms() == exp.arms
    assert exp.to_dict()["arms"] == ["aligned", "x=fp32/fp16,dispatch=sorted;correction=none"]
    assert dataclasses.replace(exp, steps=3).arms == exp.arms
    assert experiment_record(exp)["settings"]["experiment"] == exp.to_dict()

    sft = SFTConfig(policy="fp32,kernel=tiled:4")
    assert sft.policy == NumericPolicy.parse("fp32,kernel=tiled:4") and sft.to_dict()["policy"] == "fp32,kernel=tiled:4"
    model = ModelConfig.preset("tiny")
    assert cache_key(model, SFTConfig(), code="c") == cache_key(model, SFTConfig(policy=PRESETS["fp32"]), code="c")
    assert cache_key(model, SFTConfig(), code="c") != cache_key(model, sft, code="c")


def test_cli_defaults_come_from_the_definitions():
    parser = cli.make_parser()
    args = parser.parse_args(["compare"])
    assert (args.prompts, args.max_new_tokens, args.seed, args.replay, args.schedule, args.prefill_chunk) == (
        param_default(compare, "n_prompts"), param_default(compare, "max_new_tokens"), param_default(compare, "seed"),
        param_default(compare, "replay"), param_default(compare, "schedule"), param_default(compare, "prefill_chunk"))
    assert args.engine_batch == list(param_default(compare, "engine_batches"))
    assert (args.trainer, args.engine) == (NumericPolicy.preset("train-bf16"), NumericPolicy.preset("serve-bf16"))
    args = parser.parse_args(["localize", "--trainer", "fp32,kernel=tiled:4"])
    assert args.trainer == NumericPolicy.parse("fp32,kernel=tiled:4")
    assert (args.prompts, args.max_new_tokens, args.seed) == tuple(
        param_default(localize, n) for n in ("n_prompts", "max_new_tokens", "seed"))
    args = parser.parse_args(["check"])
    assert (args.prompts, args.max_new_tokens, args.seed, args.replay) == tuple(
        param_default(run_check, n) for n in ("n_prompts", "max_new_tokens", "seed", "replay"))
    args = parser.parse_args(["experiment", "countdown", "--out", "x"])
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "learning_rate", "is_threshold", "rs",
                 "eval_every", "eval_problems", "problem_count", "max_target", "max_number", "held_out"):
        assert getattr(args, name) == field_default(ExperimentConfig, name), name
    sft = field_default(ExperimentConfig, "sft")  # the experiment's warm start, not SFTConfig's own defaults
    assert (args.sft_steps, args.sft_problems, args.sft_answers) == (sft.steps, sft.problems, sft.answers)
    assert cli_experiment._arms(args) == ExperimentConfig().arms
