"""Arms as data: `NAME=TRAINER/ENGINE[;correction=MODE][;replay=R][;KEY=VALUE...]`.

TRAINER and ENGINE are numeric-policy strings (`NumericPolicy.parse`: a preset, optionally followed by
`,key=value` overrides, e.g. `aligned-bf16,kernel=xla`); they are split at the one `/`. ENGINE may instead be
`vllm[:DTYPE]` (DTYPE bf16 default, fp16, fp32): vLLM in its own process generates the arm's rollouts, synced to
the trainer's weights before every batch and each sync verified (docs/vllm.md), e.g. `real=fp32/vllm:bf16`. Arm options follow the
engine policy, separated by `;` (always unambiguous) or by `,` (also accepted for a key that is not a policy
key). A bare built-in name (`aligned`, `misaligned`) stands for its definition in `BUILTIN`.

- `correction=MODE`: the rollout correction as text (`jaxalign.rl.correction.correction_settings`: `none`,
  `tis[:C]`, `seq-tis[:C]`, `icepop[:LO_HI]`, `rs:RULE`, `bypass[+rs:RULE...]`); omitted: the experiment's
  default (`--is-threshold` / `--rs`).
- `replay=R`: `none`, `r2` (the trainer's old-policy pass routes for the update), `r3` (the engine's routes), ...;
  the modes are defined in `jaxalign.replay_modes`.
- `KEY=VALUE`: any field of `RLConfig`, `GRPOConfig` or `CorrectionConfig` by its name (`OPTION_KEYS`), read by
  that config's `parse_option` (`jaxalign.rl.options`: numbers, true/false, `+`-joined tuples), e.g.
  `;learning_rate=2e-3;group_size=4;clip_high=0.2;advantage=group-mean`. They apply after the experiment's
  settings and after `correction=` (so `;correction=tis:2;is_threshold=3` caps at 3). A field added to one of
  these configs is an option by its annotation alone. The fields in `FIXED` are refused, each with its reason:
  they would make arms incomparable, or another part of the arm sets them.

An `Arm` holds `NumericPolicy` values (and a `jaxalign.engines.VllmSpec` for a vLLM engine), parsed once, here,
and typed overrides; `Arm.spec()` writes them back as compact text (`NumericPolicy.compact`, overrides in
`OPTION_KEYS` order), and a built-in arm as its name.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from jaxalign.engines import VllmSpec, coerce_engine, engine_text
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.policy import FIELDS as POLICY_FIELDS
from jaxalign.replay_modes import REPLAY_MODES
from jaxalign.rl.correction import CorrectionConfig, correction_settings
from jaxalign.rl.options import field_types, format_value, is_nested_config
from jaxalign.rl.trainer import RLConfig

OPTIONS = ("correction", "replay")  # the arm's own options (the correction's text grammar, the replay mode)
ALIASES = {"lag": "max_lag"}  # short keys an --arm string may use (`;lag=2`), written back by their field's name
BUILTIN = {
    "aligned": "aligned=aligned-bf16/aligned-bf16",
    "misaligned": "misaligned=train-bf16/serve-bf16",
}
# RLConfig fields an arm may not set, and why
FIXED = {
    "trainer_policy": "it is the arm's TRAINER policy, before the '/'",
    "engine_policy": "it is the arm's ENGINE policy, after the '/'",
    "mode": "correction= sets it (bypass[+rs:RULE...] for bypass, any other mode for decoupled)",
    "steps": "every arm runs the experiment's --steps, so their curves compare step for step",
    "seed": "seeds are the experiment's (--seeds): every arm sees the same problems and sampling seeds",
    "max_new_tokens": "the held-out evaluation decodes this many tokens too, so held-out rewards would not compare",
    "eval_every": "every arm is evaluated at the same steps (--eval-every)",
    "eval_problems": "every arm is evaluated on the same held-out problems (--eval-problems)",
    "problem_count": "it defines the task, which every arm shares (--problem-count)",
    "checkpoint_every": "it is the experiment's bookkeeping, set from --steps (it never changes a result)",
    "trainer_mesh": "placement is the experiment's (--trainer-mesh), on the same devices for every arm",
    "engine_mesh": "placement is the experiment's (--engine-mesh), on the same devices for every arm",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
GRAMMAR = (f"NAME=TRAINER/ENGINE[;correction=MODE][;replay={'|'.join(REPLAY_MODES)}][;KEY=VALUE...], e.g. "
           "'mine=aligned-bf16,kernel=xla/serve-bf16;correction=tis:2+rs:seq_mean_k1:0.999_1.001;replay=r3;"
           "learning_rate=2e-3' (ENGINE may be vllm[:DTYPE]; KEY: a field of RLConfig, GRPOConfig or "
           "CorrectionConfig; lag = max_lag) or a built-in name ("
           + ", ".join(BUILTIN) + ")")


@functools.cache
def option_keys() -> dict[str, tuple[str | None, type]]:
    """Every `KEY` an arm may name -> (the RLConfig field holding it: None for RLConfig's own fields, else the
    nested config's field, e.g. "grpo"; the config class whose `parse_option` reads it), in field order. Built
    from the dataclasses' fields, so a new field is a key; `FIXED` and the arm's own `OPTIONS` are left out."""
    keys: dict[str, tuple[str | None, type]] = {}

    def add(key, owner, cls):
        if key in keys or key in OPTIONS:
            raise RuntimeError(f"arm option {key!r} is a field of two configs; arms could not tell them apart")
        keys[key] = (owner, cls)
    for name, tp in field_types(RLConfig).items():
        if is_nested_config(tp):
            for inner in field_types(tp):
                add(inner, name, tp)
        elif name not in FIXED and name not in OPTIONS:
            add(name, None, RLConfig)
    return keys


@functools.cache
def _policy_keys() -> frozenset[str]:
    """The keys of a policy string (`NumericPolicy.parse`)."""
    return frozenset(f.key for f in POLICY_FIELDS.values())


def _check_key(key: str) -> None:
    """A clear error for a key an arm may not set: a FIXED one (with why) or an unknown one (with the keys)."""
    if key in FIXED:
        raise ValueError(f"{key} is not an arm option: {FIXED[key]}")
    nested = {name for name, tp in field_types(RLConfig).items() if is_nested_config(tp)} - set(OPTIONS)
    if key in nested:
        raise ValueError(f"{key} is a nested config; set its fields by name ("
                         + ", ".join(k for k, (owner, _) in option_keys().items() if owner == key) + ")")
    if key not in option_keys():
        raise ValueError(f"unknown arm option {key!r}; allowed: {', '.join(OPTIONS + tuple(option_keys()))}")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: a name, the trainer and engine policies, a correction mode (None: the experiment's default),
    a router-replay mode and overrides of RLConfig / GRPOConfig / CorrectionConfig fields (a mapping or
    (key, value) pairs; values typed or text, held typed, in `option_keys()` order)."""

    name: str
    trainer: NumericPolicy  # a policy string is accepted and parsed
    engine: NumericPolicy | VllmSpec  # or vllm[:DTYPE] (text is parsed)
    correction: str | None = None
    replay: str = "none"
    overrides: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"arm name {self.name!r}: allowed letters, digits and _ . + - (it names a directory)")
        object.__setattr__(self, "trainer", NumericPolicy.coerce(self.trainer,
                                                                 label=f"arm {self.name!r}: trainer policy"))
        object.__setattr__(self, "engine", coerce_engine(self.engine, label=f"arm {self.name!r}: engine policy"))
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"arm {self.name!r}: replay {self.replay!r}; allowed: {', '.join(REPLAY_MODES)}")
        try:
            if self.correction is not None:
                correction_settings(self.correction, CorrectionConfig())
            object.__setattr__(self, "overrides", _typed_overrides(self.overrides))
            self.apply(RLConfig(**self.settings(CorrectionConfig())))  # the overrides together, in context
        except ValueError as err:
            raise ValueError(f"arm {self.name!r}: {err}") from None

    def spec(self) -> str:
        """The canonical `--arm` string of this arm (a built-in arm's name when it is that built-in)."""
        if self.name in BUILTIN and parse_arm(self.name) == self:
            return self.name
        options = "".join(f";{k}={v}" for k, v in (("correction", self.correction), ("replay", self.replay))
                          if v is not None and not (k == "replay" and v == "none"))
        options += "".join(f";{k}={format_value(v)}" for k, v in self.overrides)
        return f"{self.name}={self.trainer.compact()}/{engine_text(self.engine)}{options}"

    def settings(self, default: CorrectionConfig) -> dict:
        """The RLConfig fields the arm's policies, correction and replay set: trainer_policy, engine_policy,
        mode, correction, replay (the overrides are `apply`'s)."""
        mode, correction = correction_settings(self.correction, default)
        return {"trainer_policy": self.trainer, "engine_policy": self.engine, "mode": mode,
                "correction": correction, "replay": self.replay}

    def apply(self, config: RLConfig) -> RLConfig:
        """`config` with this arm's overrides set (nested configs' fields in their config)."""
        top, nested = {}, {}
        for key, value in self.overrides:
            owner, _ = option_keys()[key]
            if owner is None:
                top[key] = value
            else:
                nested.setdefault(owner, {})[key] = value
        for owner, fields in nested.items():
            top[owner] = dataclasses.replace(getattr(config, owner), **fields)
        return dataclasses.replace(config, **top) if top else config


def _typed_overrides(overrides) -> tuple[tuple[str, object], ...]:
    """(key, typed value) pairs in `option_keys()` order; each value read (text) or checked (typed, by its
    text form) by its config's `parse_option`."""
    pairs = list(overrides.items()) if isinstance(overrides, dict) else list(overrides)
    typed = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"overrides: expected (key, value) pairs or a mapping, got {pair!r}")
        key, value = pair
        _check_key(key)
        if key in typed:
            raise ValueError(f"{key} given twice")
        _, cls = option_keys()[key]
        typed[key] = cls.parse_option(key, value if isinstance(value, str) else format_value(value))
    return tuple((k, typed[k]) for k in option_keys() if k in typed)


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
    if ";" in trainer or any(_is_option(item) for item in trainer.split(",")):
        raise ValueError(f"--arm {text!r}: options (correction=, replay=, KEY=VALUE) go after the engine policy")
    head, sep, tail = engine_and_options.partition(";")
    engine, items = [], []
    for item in head.split(","):  # the engine policy, then options after a ',' (a key that is not a policy key)
        (items if items or _is_option(item) else engine).append(item)
    items += [item for item in re.split(r"[;,]", tail) if item.strip()] if sep else []
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if key in _policy_keys():
            raise ValueError(f"--arm {text!r}: policy item {item!r} after the arm options; put the options "
                             f"(correction=, replay=, KEY=VALUE) last")
        if not eq or not key:
            raise ValueError(f"--arm {text!r}: arm option {item!r} is not KEY=VALUE; {GRAMMAR}")
        if key in options:
            raise ValueError(f"--arm {text!r}: {key} given twice")
        options[key] = value.strip()
    if not trainer.strip() or not ",".join(engine).strip():
        raise ValueError(f"--arm {text!r}: empty trainer or engine policy; {GRAMMAR}")
    return Arm(name=name.strip(), trainer=trainer.strip(), engine=",".join(engine).strip(),
               correction=options.get("correction"), replay=options.get("replay", "none"),
               overrides=tuple((k, v) for k, v in options.items() if k not in OPTIONS))


def _is_option(item: str) -> bool:
    """Whether a `,`-separated item is an arm option (`KEY=VALUE` with an arm key that is no policy key)."""
    key, eq, _ = item.partition("=")
    key = ALIASES.get(key.strip(), key.strip())
    return bool(eq) and key not in _policy_keys() and (key in OPTIONS or key in option_keys() or key in FIXED)


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
