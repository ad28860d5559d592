"""RL that learns: on an easy task with a known answer, GRPO must raise the sampled reward within a few steps.

The task rewards a completion whose first character is a digit (a random-init model emits one ~1/3 of the time,
so most groups carry signal). A wrong sign of the advantage, logprobs misaligned with their tokens, a mask or
IS weight that zeroes the signal, or an engine not synced after the update all make this fail (with the sign
flipped the reward falls to ~0; checked by hand)."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxalign.model.config import ModelConfig
from jaxalign.model.transformer import Transformer
from jaxalign.rl import tokenizer
from jaxalign.rl.grpo import GRPOConfig
from jaxalign.rl.sft import SFTConfig, random_expression, solution_traces
from jaxalign.rl.task import CountdownTask
from jaxalign.rl.trainer import RLConfig, Trainer


@dataclasses.dataclass(frozen=True)
class FirstCharIsDigit(CountdownTask):
    """Reward 1 when the completion starts with a digit, else 0."""

    def reward(self, item, completion):
        return float(tokenizer.decode(list(completion))[:1].isdigit())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """8 GRPO steps from a random-init model on `FirstCharIsDigit`, with 1 and with 2 PPO epochs per batch."""
    out = {}
    for epochs in (1, 2):
        model = Transformer(ModelConfig.preset("countdown"), rngs=nnx.Rngs(0))
        config = RLConfig(steps=8, prompts_per_step=8, grpo=GRPOConfig(group_size=4), max_new_tokens=2,
                          learning_rate=3e-3, ppo_epochs=epochs, eval_every=8, eval_problems=8,
                          checkpoint_every=8, problem_count=(2, 2))
        trainer = Trainer(model, config, str(tmp_path_factory.mktemp(f"epochs{epochs}")),
                          task=FirstCharIsDigit(count=(2, 2), eval_size=8))
        out[epochs] = trainer.run(progress=False)
    return out


@pytest.mark.parametrize("epochs", [1, 2])
def test_grpo_raises_the_sampled_reward_on_an_easy_task(runs, epochs):
    train = [r["reward_mean"] for r in runs[epochs] if "reward_mean" in r]
    assert 0.1 < train[0] < 0.6, f"the task should start neither solved nor hopeless: {train}"
    assert np.mean(train[-3:]) > train[0] + 0.3, f"sampled reward did not rise: {train}"


def test_only_the_first_ppo_epoch_is_on_policy(runs):
    """Same first rollout; with one epoch the (aligned, decoupled) PPO ratio is exactly 1, a second epoch on
    the same batch sees the updated policy (ratio != 1) and so leads to other weights."""
    one, two = runs[1][1], runs[2][1]
    assert one["reward_mean"] == two["reward_mean"]
    assert one["ratio_mean"] == 1.0
    assert two["ratio_mean"] != 1.0
    assert runs[1][2:] != runs[2][2:]


def test_random_answers_are_well_formed_and_use_every_number_once():
    from jaxalign.rl import countdown
    rng = np.random.default_rng(0)
    for numbers in [(3, 5), (2, 7, 9), (1, 4, 4, 8)]:
        for _ in range(20):
            text = random_expression(numbers, rng)
            assert countdown.score(numbers, 10**6, f"<answer>{text}</answer>") == countdown.FORMAT_SCORE, text
    tokens, _ = solution_traces(SFTConfig(problems=50, answers="random", problem_count=(2, 2)))
    solved, _ = solution_traces(SFTConfig(problems=50, problem_count=(2, 2)))
    assert (tokens != solved).any(), "random answers must differ from the brute-force solutions"
    with pytest.raises(ValueError, match="answers"):
        SFTConfig(answers="guess")


def test_habit_answers_are_the_solution_with_probability_p_else_the_sum_in_order():
    from jaxalign.rl import countdown
    from jaxalign.rl.sft import habit_expression, parse_answers
    assert habit_expression((3, 5, 2)) == "3+5+2"
    cfg = dict(problems=400, problem_count=(2, 2), max_new_tokens=14)
    problems = countdown.generate_problems(400, seed=0, count=(2, 2))
    answers = {}
    for p_share in (0.0, 0.3, 1.0):
        tokens, _ = solution_traces(SFTConfig(**cfg, answers=f"habit:{p_share}"))
        texts = [tokenizer.decode(row[row.tolist().index(tokenizer.BOS) + 1:]) for row in tokens]
        answers[p_share] = [t.split("<answer>")[-1].split("</answer>")[0] for t in texts]
    for p, habit, solution in zip(problems, answers[0.0], answers[1.0]):
        assert habit == habit_expression(p.numbers) and solution == p.solution
    mixed = answers[0.3]
    from_solution = [m == s for m, s, h in zip(mixed, answers[1.0], answers[0.0]) if s != h]
    assert all(m in (s, h) for m, s, h in zip(mixed, answers[1.0], answers[0.0]))
    assert 0.22 < np.mean(from_solution) < 0.38  # P = 0.3 over ~300 problems whose habit is wrong
    assert parse_answers("habit:0.25") == ("habit", 0.25, "+")
    assert parse_answers("habit:0.25:/") == ("habit", 0.25, "/")
    assert habit_expression((12, 5), "/") == "12/5"
    for bad in ("habit", "habit:x", "habit:1.5", "habit:-0.1", "habbit:0.3", "habit:0.3:%", "habit:0.3:++"):
        with pytest.raises(ValueError, match="habit:P"):
            SFTConfig(answers=bad)
