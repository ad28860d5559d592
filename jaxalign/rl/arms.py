"""Arms as data: `NAME=TRAINER/ENGINE[;correction=MODE][;replay=R]`.

TRAINER and ENGINE are numeric-policy strings (`NumericPolicy.parse`: a preset, optionally followed by
`,key=value` overrides, e.g. `aligned-bf16,kernel=xla`); they are split at the one `/`. Arm options follow the
engine policy, separated by `;` (always unambiguous) or by `,` (also accepted: `correction` and `replay` are not
policy keys). A bare built-in name (`aligned`, `misaligned`) stands for its definition in `BUILTIN`.

Correction modes (how the PPO loss treats the trainer/engine gap):
- `none`: the common bug -- the PPO ratio is taken against the trainer's recomputed logprobs and the engine's
  logprobs are ignored (no importance weights, no rejection).
- verl's decoupled mode, `+`-joined parts: `tis[:C]` (token-level truncated IS, cap C, default 2),
  `seq-tis[:C]` (sequence-level), `icepop[:LO_HI]` (token IS zeroed outside [LO, HI], default 0.5_2), and any
  number of `rs:RULE` rejection rules (`rs:seq_mean_k1:0.999_1.001` is verl's geometric RS; see
  `correction.RS_MODES`), e.g. `tis:2+rs:seq_mean_k1:0.999_1.001`.
- `bypass[+rs:RULE...]`: the PPO ratio is taken against the engine's logprobs (pi_old := pi_rollout).
- `drop:F`: a control, no correction: a fraction F of each batch's sequences dropped at random
  (`correction.random_keep`), to tell what rejection sampling's selection does from what its smaller batch does.
- omitted: the experiment's default (`--is-threshold` / `--rs`).

Replay: `none`, `r2` (the trainer's old-policy pass routes for the update), `r3` (the engine's routes); the modes
are defined in `jaxalign.replay_modes`.

An `Arm` holds `NumericPolicy` values (parsed once, here); `Arm.spec()` writes them back as compact text
(`NumericPolicy.compact`), and a built-in arm as its name.
"""

from __future__ import annotations

import dataclasses
import re

from jaxalign.numerics import NumericPolicy
from jaxalign.replay_modes import REPLAY_MODES
from jaxalign.rl.correction import BYPASS, DECOUPLED, CorrectionConfig
OPTIONS = ("correction", "replay")
BUILTIN = {
    "aligned": "aligned=aligned-bf16/aligned-bf16",
    "misaligned": "misaligned=train-bf16/serve-bf16",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
GRAMMAR = (f"NAME=TRAINER/ENGINE[;correction=MODE][;replay={'|'.join(REPLAY_MODES)}], e.g. "
           "'mine=aligned-bf16,kernel=xla/serve-bf16;correction=tis:2+rs:seq_mean_k1:0.999_1.001;replay=r3' "
           "or a built-in name (" + ", ".join(BUILTIN) + ")")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: a name, the trainer and engine policies, a correction mode (None: the experiment's default)
    and a router-replay mode."""

    name: str
    trainer: NumericPolicy  # a policy string is accepted and parsed
    engine: NumericPolicy
    correction: str | None = None
    replay: str = "none"

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"arm name {self.name!r}: allowed letters, digits and _ . + - (it names a directory)")
        for side in ("trainer", "engine"):
            object.__setattr__(self, side, NumericPolicy.coerce(getattr(self, side),
                                                                label=f"arm {self.name!r}: {side} policy"))
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"arm {self.name!r}: replay {self.replay!r}; allowed: {', '.join(REPLAY_MODES)}")
        if self.correction is not None:
            try:
                correction_settings(self.correction, CorrectionConfig())
            except ValueError as err:
                raise ValueError(f"arm {self.name!r}: {err}") from None

    def spec(self) -> str:
        """The canonical `--arm` string of this arm (a built-in arm's name when it is that built-in)."""
        if self.name in BUILTIN and parse_arm(self.name) == self:
            return self.name
        options = "".join(f";{k}={v}" for k, v in (("correction", self.correction), ("replay", self.replay))
                          if v is not None and not (k == "replay" and v == "none"))
        return f"{self.name}={self.trainer.compact()}/{self.engine.compact()}{options}"

    def settings(self, default: CorrectionConfig) -> dict:
        """The RLConfig fields this arm sets: trainer_policy, engine_policy, mode, correction, replay."""
        mode, correction = correction_settings(self.correction, default)
        return {"trainer_policy": self.trainer, "engine_policy": self.engine, "mode": mode,
                "correction": correction, "replay": self.replay}


def correction_settings(text: str | None, default: CorrectionConfig) -> tuple[str, CorrectionConfig]:
    """(mode, CorrectionConfig) of a correction mode string (module docstring); None gives `default`."""
    if text is None:
        return DECOUPLED, default
    parts = [p.strip() for p in text.split("+")]
    if parts == ["none"]:
        return DECOUPLED, CorrectionConfig(is_level="none", rs=())
    if len(parts) == 1 and parts[0].startswith("drop:"):
        try:
            fraction = float(parts[0][5:])
        except ValueError:
            fraction = -1.0
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"correction {text!r}: drop takes a fraction 0 < F < 1, e.g. drop:0.45")
        return DECOUPLED, CorrectionConfig(is_level="none", rs=(), random_drop=fraction)
    mode = DECOUPLED
    if parts[0] == BYPASS:
        mode, parts = BYPASS, parts[1:]
    is_level, threshold, rs = "none", "2.0", []
    for part in parts:
        kind, _, value = part.partition(":")
        if kind == "rs" and value:
            rs.append(value)
        elif kind in ("tis", "seq-tis", "icepop") and mode == DECOUPLED:
            if is_level != "none":
                raise ValueError(f"correction {text!r}: at most one of tis, seq-tis, icepop")
            is_level = "sequence" if kind == "seq-tis" else "token"
            threshold = value or ("0.5_2.0" if kind == "icepop" else "2.0")
            if kind == "icepop" and "_" not in threshold:
                raise ValueError(f"correction {text!r}: icepop takes a band LO_HI, e.g. icepop:0.5_2.0")
            if kind != "icepop" and "_" in threshold:
                raise ValueError(f"correction {text!r}: {kind} takes a cap C, e.g. {kind}:2.0")
        else:
            raise ValueError(f"correction {text!r}: unknown part {part!r}; allowed: none, drop:F, bypass[+rs:RULE...], or "
                             f"+-joined tis[:C], seq-tis[:C], icepop[:LO_HI], rs:RULE")
    return mode, CorrectionConfig(is_level=is_level, is_threshold=threshold, rs=tuple(rs),
                                  normalize_weights=default.normalize_weights)


def parse_arm(text: "str | Arm") -> Arm:
    """An `Arm` from its `--arm` string (see the module docstring); a clear error on anything else. An `Arm`
    passes through."""
    if isinstance(text, Arm):
        return text
    if not isinstance(text, str):
        raise ValueError(f"an arm must be an Arm or an --arm string, got {type(text).__name__}; {GRAMMAR}")
    text = text.strip()
    if text in BUILTIN:
        text = BUILTIN[text]
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--arm {text!r} does not parse; expected {GRAMMAR}")
    policies = rest.split("/")
    if len(policies) != 2:
        raise ValueError(f"--arm {text!r}: expected one '/' between the trainer and engine policies; {GRAMMAR}")
    trainer, engine_and_options = policies
    if ";" in trainer or any(item.partition("=")[0].strip() in OPTIONS for item in trainer.split(",")):
        raise ValueError(f"--arm {text!r}: options (correction=, replay=) go after the engine policy")
    engine, options = [], {}
    for item in re.split(r"[;,]", engine_and_options):
        key, eq, value = item.partition("=")
        if key.strip() in OPTIONS and eq:
            if key.strip() in options:
                raise ValueError(f"--arm {text!r}: {key.strip()} given twice")
            options[key.strip()] = value.strip()
        elif options:
            raise ValueError(f"--arm {text!r}: policy item {item!r} after the arm options; put correction= and "
                             f"replay= last")
        else:
            engine.append(item)
    if not trainer.strip() or not ",".join(engine).strip():
        raise ValueError(f"--arm {text!r}: empty trainer or engine policy; {GRAMMAR}")
    return Arm(name=name.strip(), trainer=trainer.strip(), engine=",".join(engine).strip(),
               correction=options.get("correction"), replay=options.get("replay", "none"))


def parse_arms(texts) -> tuple[Arm, ...]:
    """Parse every `--arm` (or pass `Arm`s through); arms whose names collide (they would write the same
    directory) are an error."""
    arms = tuple(parse_arm(t) for t in texts)
    if not arms:
        raise ValueError(f"at least one arm is needed; {GRAMMAR}")
    seen = {}
    for arm in arms:
        key = arm.name.lower()  # case-insensitive file systems would merge these directories
        if key in seen:
            raise ValueError(f"arms {seen[key]!r} and {arm.name!r} would write the same directory; give each arm "
                             f"its own name")
        seen[key] = arm.name
    return arms
