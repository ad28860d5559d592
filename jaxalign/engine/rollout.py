"""Rollout: what the engine returns -- tokens, the engine's logprobs, masks and routing, ready for the trainer."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxalign.model.routing import RoutingRecord
from jaxalign.numerics.sampling import SamplingParams


@dataclasses.dataclass
class Rollout:
    """A batch of finished requests, laid out so the trainer can score them directly.

    - `tokens` int32 [R, S]: prompt then completion, right-padded with 0.
    - `logprobs` float32 [R, S-1]: entry t is the engine's logprob of `tokens[:, t+1]` (same layout as
      `token_logprobs`); defined where `mask` is True (completion tokens), 0 elsewhere.
    - `mask` bool [R, S-1]: completion tokens.
    - `prompt_lens`, `completion_lens` int [R]; `finish_reasons` list of "eos" | "length".
    - `routing`: RoutingRecord [R, S, moe_layers, k] of every forwarded token (the prompt and all but the last
      completion token); -1 elsewhere. Its `weights` are the engine's combine weights (f32) and, for a DSA model,
      `index_positions` [R, S, layers, index_topk] the keys the engine's indexer chose (what index replay replays).
    - `sampling`: the `SamplingParams` the tokens were drawn with (and that says which logprob `logprobs` holds);
      scoring the rollout on the trainer side reads it from here.
    - `stats`: engine facts (schedule, batch size, compiles, seconds).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    prompt_lens: np.ndarray
    completion_lens: np.ndarray
    finish_reasons: list[str]
    routing: RoutingRecord
    sampling: SamplingParams = SamplingParams()
    stats: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def prompt(self, i: int) -> np.ndarray:
        """Prompt tokens of request i."""
        return self.tokens[i, : self.prompt_lens[i]]

    def completion(self, i: int) -> np.ndarray:
        """Generated tokens of request i (including the eos token if it finished on one)."""
        p = self.prompt_lens[i]
        return self.tokens[i, p: p + self.completion_lens[i]]

    def completion_logprobs(self, i: int) -> np.ndarray:
        """The engine's logprob of each generated token of request i."""
        p = self.prompt_lens[i]
        return self.logprobs[i, p - 1: p - 1 + self.completion_lens[i]]

    def select(self, rows) -> "Rollout":
        """A Rollout of some requests (in the given order)."""
        rows = np.asarray(rows)
        return Rollout(tokens=self.tokens[rows], logprobs=self.logprobs[rows], mask=self.mask[rows],
                       prompt_lens=self.prompt_lens[rows], completion_lens=self.completion_lens[rows],
                       finish_reasons=[self.finish_reasons[i] for i in rows],
                       routing=self.routing.rows(rows),
                       sampling=self.sampling, stats=dict(self.stats))
