"""Router replay modes: which experts the trainer's forward pass uses. Defined once; `compare`, `localize`,
`check`, the RL trainer, the arms grammar and the CLI import them from here.

- `none`: the trainer routes natively (its own router under its own policy).
- `r2`: the experts a separate trainer pass of the old policy picked (at identical weights, the trainer's own
  native routing; in RL, the old-policy pass routes the update).
- `r3`: the experts the engine recorded while generating (rollout routing replay).
"""

from __future__ import annotations

REPLAY_MODES = ("none", "r2", "r3")
# localize scores every policy variant against one engine pass: only the engine's recorded routes (or none) can be
# replayed into those variants, the trainer's old-policy pass (r2) has no meaning there
ENGINE_REPLAY_MODES = tuple(mode for mode in REPLAY_MODES if mode != "r2")


def check_replay(replay: str, allowed: tuple[str, ...] = REPLAY_MODES, *, label: str = "replay") -> str:
    """`replay` when it is one of `allowed`, else a ValueError naming it and what is allowed."""
    if replay not in allowed:
        raise ValueError(f"{label} = {replay!r}; allowed: {', '.join(allowed)}")
    return replay
