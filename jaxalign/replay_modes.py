"""Replay modes: which experts (and, for DSA models, which keys) the trainer's forward pass uses. Defined once;
`compare`, `localize`, `check`, the RL trainer, the arms grammar and the CLI import them from here.

Expert replay:
- `none`: the trainer routes natively (its own router under its own policy).
- `r2`: the experts a separate trainer pass of the old policy picked (at identical weights, the trainer's own
  native routing; in RL, the old-policy pass routes the update).
- `r3`: the experts the engine recorded while generating (rollout routing replay); gate weights recomputed from
  the trainer's own router scores.
- `r3w`: the engine's experts and its combine weights, used as constants (no gradient reaches the router through
  the weights).
Index replay (models with an indexer: DSA, DeepSeek-V4's CSA layers): `index` alone, or `r3+index` /
`r3w+index`: the trainer's sparse attention reads the keys (CSA: compressed entries) the engine's indexer selected.
"""

from __future__ import annotations

EXPERT_REPLAY_MODES = ("none", "r2", "r3", "r3w")
REPLAY_MODES = EXPERT_REPLAY_MODES + ("index", "r3+index", "r3w+index")
# localize scores every policy variant against one engine pass and replays the engine's recorded experts into
# them (or nothing): the trainer's old-policy pass (r2), recorded weights and index records are not replayed there
ENGINE_REPLAY_MODES = ("none", "r3")


def check_replay(replay: str, allowed: tuple[str, ...] = REPLAY_MODES, *, label: str = "replay") -> str:
    """`replay` when it is one of `allowed`, else a ValueError naming it and what is allowed."""
    if replay not in allowed:
        raise ValueError(f"{label} = {replay!r}; allowed: {', '.join(allowed)}")
    return replay


def replay_parts(mode: str) -> tuple[str, bool]:
    """Split a replay mode into (expert replay: none | r2 | r3 | r3w, whether indexer selections are replayed)."""
    check_replay(mode)
    if mode == "index":
        return "none", True
    expert, _, index = mode.partition("+")
    return expert, index == "index"
