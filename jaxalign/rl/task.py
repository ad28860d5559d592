"""What the RL trainer needs from a task, and Countdown as one.

A `Task` hands out training items deterministically in (seed, step), a fixed held-out set, the prompt of an item
as token ids (at most `prompt_width` of them, so trainer shapes stay fixed) and the reward of a completion. The
trainer knows nothing else about the task; another task plugs in by implementing these five members.
"""

from __future__ import annotations

import dataclasses
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


PROMPT_WIDTH = 24  # every Countdown prompt (<bos> + up to 4 numbers + target) fits


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Countdown with `count` = (min, max) numbers in [low, high] and targets up to `max_target`. The prompt ends
    with the opening <answer> tag, so the completion is the expression and its closing tag."""

    count: tuple[int, int] = (3, 3)
    low: int = 1
    high: int = 9
    max_target: int = 99
    eval_size: int = 64
    prompt_width: int = PROMPT_WIDTH

    def __post_init__(self):
        countdown.generate_problems(1, seed=0, count=tuple(self.count), low=self.low, high=self.high,
                                    max_target=self.max_target)  # validates the ranges
        if self.eval_size < 1:
            raise ValueError(f"eval_size = {self.eval_size}; allowed: >= 1")

    def _problems(self, n: int, seed: int) -> list[countdown.Problem]:
        return countdown.generate_problems(n, seed=seed, count=tuple(self.count), low=self.low, high=self.high,
                                           max_target=self.max_target)

    def train_items(self, step: int, n: int, seed: int) -> list[countdown.Problem]:
        """`n` problems for `step` (seed * 100003 + step seeds the generator)."""
        return self._problems(n, seed * 100_003 + step)

    def eval_items(self, seed: int) -> list[countdown.Problem]:
        """`eval_size` held-out problems (generator seed 1000003 + seed; disjoint seeds from training)."""
        return self._problems(self.eval_size, 1_000_003 + seed)

    def prompt(self, item: countdown.Problem) -> list[int]:
        """<bos> + "numbers=target:<answer>"."""
        ids = tokenizer.encode(item.prompt(), bos=True)
        if len(ids) > self.prompt_width:
            raise ValueError(f"prompt {item.prompt()!r} has {len(ids)} tokens > prompt_width {self.prompt_width}")
        return ids

    def reward(self, item: countdown.Problem, completion: Sequence[int]) -> float:
        """TinyZero's Countdown reward (`countdown.score`): 1 correct, 0.1 well-formed, 0 otherwise."""
        return countdown.score(item.numbers, item.target, "<answer>" + tokenizer.decode(list(completion)))

    def describe(self) -> dict:
        """The task's settings."""
        return {"name": "countdown", **dataclasses.asdict(self)}
