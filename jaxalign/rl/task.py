"""What the RL trainer needs from a task, and Countdown as one.

A `Task` hands out training items deterministically in (seed, step), a fixed held-out set, the prompt of an item
as token ids (at most `prompt_width` of them, so trainer shapes stay fixed) and the reward of a completion. The
trainer knows nothing else about the task; another task plugs in by implementing these five members.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

from jaxalign.rl import countdown, tokenizer


class Task(Protocol):
    """The RL task interface (see the module docstring)."""

    prompt_width: int

    def train_items(self, step: int, n: int, seed: int) -> list[Any]:
        """`n` items for training step `step`; deterministic in (seed, step)."""

    def eval_items(self, seed: int) -> list[Any]:
        """The held-out items (the same for every step of a run)."""

    def prompt(self, item: Any) -> list[int]:
        """The prompt's token ids (<= prompt_width)."""

    def reward(self, item: Any, completion: Sequence[int]) -> float:
        """The reward of a completion (token ids, without the prompt)."""

    def describe(self) -> dict:
        """The settings that define the task (JSON-ready; recorded in the run directory)."""


@functools.lru_cache(maxsize=8)
def _held_out(fraction, count, low, high, max_target, limit, targets) -> list[countdown.Problem]:
    return countdown.held_out_problems(fraction, count=count, low=low, high=high, max_target=max_target,
                                       limit=limit, targets=targets)


PROMPT_WIDTH = 24  # every Countdown prompt (<bos> + up to 4 numbers + target) fits


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Countdown with `count` = (min, max) numbers in [low, high] and targets up to `max_target`. The prompt ends
    with the opening <answer> tag, so the completion is the expression and its closing tag.

    `held_out` > 0 splits the problem space (`countdown.is_held_out`: that fraction of all (numbers, target)
    problems, by a hash): training never draws a held-out problem, and evaluation is the held-out split (all of
    it, or its first `eval_size` problems), the same for every seed. `held_out` = 0 keeps the older evaluation,
    problems drawn from seeds disjoint from training's, which can repeat training problems in a small space."""

    count: tuple[int, int] = (3, 3)
    low: int = 1
    high: int = 9
    max_target: int = 99
    eval_size: int = 64
    prompt_width: int = PROMPT_WIDTH
    held_out: float = 0.0
    answer_format: str = "bare"  # `countdown.ANSWER_FORMATS`: bare (prompt opens <answer>) or steps (worked steps)
    targets: str = "any"  # `countdown.TARGET_KINDS`: any reachable target, or chain (left to right in the order shown)

    def __post_init__(self):
        countdown.generate_problems(1, seed=0, count=tuple(self.count), low=self.low, high=self.high,
                                    max_target=self.max_target, targets=self.targets)  # validates the ranges
        if not 0.0 <= self.held_out < 1.0:
            raise ValueError(f"held_out = {self.held_out}; allowed: 0 <= held_out < 1 (the held-out fraction)")
        countdown.check_answer_format(self.answer_format)
        if self.eval_size < 1:
            raise ValueError(f"eval_size = {self.eval_size}; allowed: >= 1")

    def _problems(self, n: int, seed: int) -> list[countdown.Problem]:
        return countdown.generate_problems(n, seed=seed, count=tuple(self.count), low=self.low, high=self.high,
                                           max_target=self.max_target, held_out=self.held_out, targets=self.targets)

    def train_items(self, step: int, n: int, seed: int) -> list[countdown.Problem]:
        """`n` problems for `step` (seed * 100003 + step seeds the generator)."""
        return self._problems(n, seed * 100_003 + step)

    def eval_items(self, seed: int) -> list[countdown.Problem]:
        """The held-out split (its first `eval_size` problems; every seed the same) when `held_out` > 0, else
        `eval_size` problems from generator seed 1000003 + seed (disjoint seeds from training's)."""
        if self.held_out:
            return _held_out(self.held_out, tuple(self.count), self.low, self.high, self.max_target, self.eval_size,
                             self.targets)
        return countdown.generate_problems(self.eval_size, seed=1_000_003 + seed, count=tuple(self.count),
                                           low=self.low, high=self.high, max_target=self.max_target,
                                           targets=self.targets)

    def prompt(self, item: countdown.Problem) -> list[int]:
        """<bos> + "numbers=target:<answer>" (`steps`: without the tag)."""
        text = item.prompt(self.answer_format)
        ids = tokenizer.encode(text, bos=True)
        if len(ids) > self.prompt_width:
            raise ValueError(f"prompt {text!r} has {len(ids)} tokens > prompt_width {self.prompt_width}")
        return ids

    def reward(self, item: countdown.Problem, completion: Sequence[int]) -> float:
        """TinyZero's Countdown reward (`countdown.score`): 1 correct, 0.1 well-formed, 0 otherwise -- on the
        completion with the prompt's opening tag (`bare`) or as it is (`steps`: it opens the tag itself)."""
        text = tokenizer.decode(list(completion))
        return countdown.score(item.numbers, item.target, countdown.OPEN + text if self.answer_format == "bare"
                               else text)

    def describe(self) -> dict:
        """The task's settings (the answer format and target kind only when not the defaults: what runs recorded
        before the fields existed)."""
        out = {"name": "countdown", **dataclasses.asdict(self)}
        for name, legacy in (("answer_format", "bare"), ("targets", "any")):
            if out[name] == legacy:
                del out[name]
        return out
