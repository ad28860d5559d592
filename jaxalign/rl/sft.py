"""SFT warm start: brute-force solutions of generated Countdown problems, a short supervised run, and a cache so
every arm and seed of an experiment starts from the same weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxalign.checkpoint import load_model, save_model
from jaxalign.model.config import ModelConfig
from jaxalign.model.scoring import sequence_logprobs
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.rl import countdown, tokenizer
from jaxalign.rl.rundir import code_fingerprint
from jaxalign.rl.trainer import PROMPT_WIDTH, make_optimizer


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Warm-start settings; together with the model config they key the cache."""

    problems: int = 4000
    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    max_new_tokens: int = 14
    policy: NumericPolicy = NumericPolicy.preset("fp32")  # a policy string is accepted and parsed
    problem_count: tuple[int, int] = (2, 2)
    answers: str = "habit:0.3"  # "solution", "random" or "habit:P[:OP]" (see ANSWERS)
    max_number: int = 9  # problems' numbers lie in 1..max_number
    max_target: int = 99
    held_out: float = 0.0  # the task's held-out fraction: the warm start never trains on a held-out problem
    answer_format: str = "bare"  # the task's (`countdown.ANSWER_FORMATS`): the traces are laid out as it answers
    targets: str = "any"  # the task's target kind (`countdown.TARGET_KINDS`)

    def __post_init__(self):
        object.__setattr__(self, "policy", NumericPolicy.coerce(self.policy, label="SFTConfig.policy"))
        parse_answers(self.answers)
        countdown.check_answer_format(self.answer_format)
        countdown.check_target_kind(self.targets)

    def check_batches(self) -> None:
        """Training needs `problems` >= `batch_size` (each step draws a batch without replacement)."""
        if self.steps and self.problems < self.batch_size:
            raise ValueError(f"SFTConfig.problems = {self.problems} is fewer than batch_size = {self.batch_size} "
                             f"(each SFT step draws a batch without replacement); allowed: problems >= batch_size")

    def to_dict(self) -> dict:
        """JSON-ready form; the policy as compact text (`NumericPolicy.compact`)."""
        out = {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "policy": self.policy.compact()}
        for name, legacy in (("answer_format", "bare"), ("targets", "any")):
            if out[name] == legacy:  # as warm starts (and their cache keys) were before the field existed
                del out[name]
        return out


# What the warm start is trained to answer:
# - "solution": the brute-force solution (the model learns to solve);
# - "random": a random well-formed expression over the numbers (format only; right by chance);
# - "habit:P[:OP]": the solution with probability P, else the habit expression, the numbers in the given order joined
#   by OP (one of + - * /; default +; `habit_expression`). The model learns to solve *and* a habit that greedy decoding prefers whenever P < 1/2,
#   so its greedy answers are mostly the habit while the solution is among its samples: the regime in which RL on
#   a pretrained model raises greedy reward (it moves probability onto answers the model can already produce).
ANSWERS = ("solution", "random", "habit:P[:OP]")
HABIT_OPS = "+-*/"


def parse_answers(answers: str) -> tuple[str, float, str]:
    """("solution" | "random" | "habit", P, OP): the mode and, for habit, the probability of the solution and the
    habit's operator ("+" unless given)."""
    if answers in ("solution", "random"):
        return answers, 1.0 if answers == "solution" else 0.0, "+"
    mode, _, rest = answers.partition(":")
    share, _, op = rest.partition(":")
    try:
        probability = float(share)
    except ValueError:
        probability = -1.0
    op = op or "+"
    if mode != "habit" or not 0.0 <= probability <= 1.0 or op not in HABIT_OPS or len(op) != 1:
        raise ValueError(f"SFTConfig.answers = {answers!r}; allowed: solution, random, habit:P[:OP] with "
                         f"0 <= P <= 1 and OP one of {' '.join(HABIT_OPS)} (e.g. habit:0.3 or habit:0.3:/)")
    return mode, probability, op


def habit_expression(numbers, op: str = "+") -> str:
    """The warm start's habit: the numbers in the order given, joined by `op` (right only when that expression
    happens to be the target: often for +, rarely for /)."""
    return op.join(str(n) for n in numbers)


def random_expression(numbers, rng: np.random.Generator) -> str:
    """A well-formed expression using each of `numbers` once with random operators and grouping (right only by
    chance): the warm start for RL that must learn correctness, not the format."""
    parts = [str(n) for n in numbers]
    while len(parts) > 1:
        i, j = rng.choice(len(parts), 2, replace=False)
        joined = f"({parts[i]}{'+-*/'[rng.integers(4)]}{parts[j]})"
        parts = [p for k, p in enumerate(parts) if k not in (i, j)] + [joined]
    return parts[0][1:-1] if parts[0].startswith("(") else parts[0]


def sft_problems(cfg: SFTConfig) -> list[countdown.Problem]:
    """The problems the warm start trains on (none from the task's held-out split)."""
    return countdown.generate_problems(cfg.problems, seed=cfg.seed, count=cfg.problem_count, high=cfg.max_number,
                                       max_target=cfg.max_target, held_out=cfg.held_out, targets=cfg.targets)


def solution_traces(cfg: SFTConfig) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences [N, W] (prompt + completion + eos: the answer as `cfg.answers` says, see ANSWERS, laid out
    in `cfg.answer_format`, `countdown.completion_text`) and the mask of target positions [N, W-1]."""
    width = PROMPT_WIDTH + cfg.max_new_tokens
    problems = sft_problems(cfg)
    rng = np.random.default_rng(cfg.seed)
    mode, solution_share, habit_op = parse_answers(cfg.answers)
    tokens = np.zeros((len(problems), width), np.int32)
    mask = np.zeros((len(problems), width - 1), bool)
    for i, p in enumerate(problems):
        prompt = tokenizer.encode(p.prompt(cfg.answer_format), bos=True)
        if mode == "random":
            text = random_expression(p.numbers, rng)
        elif mode == "habit" and rng.random() >= solution_share:
            text = habit_expression(p.numbers, habit_op)
        else:
            text = p.solution
        answer = tokenizer.encode(countdown.completion_text(text, cfg.answer_format), eos=True)
        if len(prompt) > PROMPT_WIDTH or len(answer) > cfg.max_new_tokens:
            raise ValueError(f"problem {p} does not fit the prompt width / max_new_tokens")
        tokens[i, : len(prompt) + len(answer)] = prompt + answer
        mask[i, len(prompt) - 1: len(prompt) - 1 + len(answer)] = True
    return tokens, mask


def cache_key(model_config: ModelConfig, cfg: SFTConfig, code: str | None = None) -> str:
    """Stable key of (architecture, SFT settings, code): `code` defaults to `code_fingerprint()`."""
    blob = json.dumps({"model": model_config.to_dict(), "sft": cfg.to_dict(),
                       "code": code or code_fingerprint()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def warm_start(model_config: ModelConfig, cfg: SFTConfig, cache_dir: str, *, progress: bool = True) -> Transformer:
    """The SFT'd model: loaded from `cache_dir` when this (config, settings) pair was trained before by this
    build (same jaxalign source and JAX version, `code_fingerprint`)."""
    from tqdm import tqdm

    cfg.check_batches()
    path = os.path.join(cache_dir, f"warmstart-{cache_key(model_config, cfg)}")
    if os.path.exists(os.path.join(path, "config.json")):
        return load_model(path)
    model = Transformer(model_config, rngs=nnx.Rngs(cfg.seed))
    tokens, mask = solution_traces(cfg)
    policy = cfg.policy
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(cfg.learning_rate, 0.0, 1.0)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch, batch_mask):
        def loss_fn(p):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, p), batch, policy)
            return -jnp.sum(lp * batch_mask) / jnp.sum(batch_mask)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(cfg.seed)
    for _ in tqdm(range(cfg.steps), desc="SFT warm start", disable=not progress):
        rows = rng.choice(len(tokens), cfg.batch_size, replace=False)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens[rows]), jnp.asarray(mask[rows]))
    nnx.update(model, params)
    from jaxalign.distributed import is_primary
    if is_primary():  # with several processes, every one trains the same model; one writes the cache
        save_model(model, path, overwrite=True)
    return model
