"""`RLConfig`: everything an RL run depends on besides its warm-start weights (the trainer's and the engine's
numerics, the GRPO and correction settings, sizes, lag, placement), and `behaviour_version`, the weight version
that generates each batch of an asynchronous run.

`engine_policy` names the arm's rollout engine: a jaxalign policy (jaxalign's own engine, the default) or
`vllm[:DTYPE]` (`jaxalign.engines.VllmSpec`: vLLM in its own process, docs/vllm.md), which records no routing and
takes no mesh, so the settings that need either are refused with it.
"""

from __future__ import annotations

import dataclasses
import json

from jaxalign.engines import VllmSpec, coerce_engine, engine_text
from jaxalign.model.sharding import parse_mesh_spec
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.precision import float16_fields
from jaxalign.replay_modes import REPLAY_MODES, check_replay, replay_parts
from jaxalign.rl import options
from jaxalign.rl.correction import DECOUPLED, MODES, CorrectionConfig
from jaxalign.rl.grpo import GRPOConfig


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Everything an RL run depends on (besides the warm-start weights)."""

    trainer_policy: NumericPolicy = NumericPolicy.preset("aligned-bf16")  # a policy string is accepted and parsed
    # the rollout engine: a jaxalign policy (its own engine) or vllm[:DTYPE] (a VllmSpec; text is parsed)
    engine_policy: NumericPolicy | VllmSpec = NumericPolicy.preset("aligned-bf16")
    steps: int = 20
    prompts_per_step: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    learning_rate: float = 3e-4
    ppo_epochs: int = 1  # passes over each collected batch (PPO epochs)
    # each pass splits the batch into this many disjoint minibatches, one optimizer step each (verl's
    # ppo_mini_batch_size = batch / minibatches): after the first, the PPO ratio leaves 1 and the clip acts
    minibatches: int = 1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mode: str = DECOUPLED
    replay: str = "none"
    grpo: GRPOConfig = GRPOConfig()
    correction: CorrectionConfig = CorrectionConfig()
    seed: int = 0
    checkpoint_every: int = 5
    eval_every: int = 5
    eval_problems: int = 64
    engine_batch: int | None = None
    problem_count: tuple[int, int] = (3, 3)
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None  # None: the model's attention projections (`attention_targets`)
    trainer_mesh: str = ""  # a mesh spec (`jaxalign.make_mesh`), e.g. "data=2,expert=2,tensor=2"; "" = one device
    engine_mesh: str = ""  # with several processes: a mesh over each process's own devices
    max_lag: int = 0  # k: batch t is generated with the weights of version max(0, t - k) (0 = synchronous)
    # measure the numerics/staleness split on every N-th batch (0: never). At lag > 0 it costs one more trainer
    # pass, at the older weights (on the rollout worker); at lag 0 it is free and always measured.
    split_every: int = 1
    # at each evaluation also sample the held-out prompts from the engine (temperature `temperature`) and report
    # their mean reward as `eval_engine_reward`: what the engine's numerics make of the policy
    eval_sampled: bool = False

    def __post_init__(self):
        object.__setattr__(self, "trainer_policy", NumericPolicy.coerce(self.trainer_policy, label="trainer_policy"))
        object.__setattr__(self, "engine_policy", coerce_engine(self.engine_policy, label="engine_policy"))
        if float16_fields(self.trainer_policy):
            raise ValueError(
                f"trainer_policy asks for f16 in {', '.join(float16_fields(self.trainer_policy))}: float16 training "
                f"needs dynamic loss scaling (gradients below 6e-8 flush to zero, above 65504 overflow), which "
                f"jaxalign does not implement; allowed trainer dtypes: f32, bf16 (an f16 engine_policy is allowed)")
        parse_mesh_spec(self.trainer_mesh)
        parse_mesh_spec(self.engine_mesh)
        if self.mode not in MODES:
            raise ValueError(f"mode = {self.mode!r}; allowed: {', '.join(MODES)}")
        check_replay(self.replay, REPLAY_MODES)
        for name in ("steps", "prompts_per_step", "max_new_tokens", "checkpoint_every", "eval_every",
                     "eval_problems", "ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} = {getattr(self, name)}; allowed: >= 1")
        if not isinstance(self.split_every, int) or isinstance(self.split_every, bool) or self.split_every < 0:
            raise ValueError(f"RLConfig.split_every = {self.split_every!r}; allowed: an int >= 0 (0 = never at "
                             f"lag > 0)")
        rows = self.prompts_per_step * self.grpo.group_size
        if rows % self.minibatches:
            raise ValueError(f"RLConfig.minibatches = {self.minibatches} does not divide the batch of {rows} rows "
                             f"(prompts_per_step x group_size); allowed: a divisor of {rows}")
        if not isinstance(self.max_lag, int) or isinstance(self.max_lag, bool) or self.max_lag < 0:
            raise ValueError(f"RLConfig.max_lag = {self.max_lag!r}; allowed: an int >= 0 (0 = synchronous rollouts)")
        if self.external_engine:
            self._check_external_engine()

    @property
    def external_engine(self) -> bool:
        """Whether the rollout engine is an external one (vLLM) rather than jaxalign's own."""
        return isinstance(self.engine_policy, VllmSpec)

    def _check_external_engine(self) -> None:
        """What a vLLM engine cannot do, refused by name: replay its routes (it records none on the CPU), run on
        an engine mesh, take LoRA adapters (it is sent exported full weights)."""
        expert_replay, with_index = replay_parts(self.replay)
        if expert_replay in ("r3", "r3w") or with_index:
            raise ValueError(f"replay = {self.replay!r} replays the engine's routes, and {self.engine_policy} records "
                             f"none (vLLM's CPU runner cannot return routed experts, docs/vllm.md); allowed with a "
                             f"vLLM engine: none, r2")
        if self.engine_mesh:
            raise ValueError(f"engine_mesh = {self.engine_mesh!r}: meshes apply to jaxalign's own engine; "
                             f"{self.engine_policy} runs in its own process (allowed: '')")
        if self.lora_rank:
            raise ValueError(f"lora_rank = {self.lora_rank}: {self.engine_policy} is sent exported full weights, "
                             f"not LoRA adapters; allowed with a vLLM engine: 0")

    @classmethod
    def parse_option(cls, key: str, text: str):
        """The typed value of field `key` written as `text` (`jaxalign.rl.options`), e.g. ("learning_rate",
        "2e-3") -> 0.002; a clear error naming the key, the value and what is allowed."""
        return options.parse_option(cls, key, text)

    def to_dict(self) -> dict:
        """JSON-ready form; policies as compact text (`NumericPolicy.compact`)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (NumericPolicy, VllmSpec)):
                value = engine_text(value)
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out[field.name] = value
        if not self.max_lag:  # synchronous runs record what they recorded before the field existed (they resume)
            del out["max_lag"]
        # likewise the fields added later, at the values runs had before them
        for name, legacy in (("split_every", 1), ("minibatches", 1), ("eval_sampled", False)):
            if getattr(self, name) == legacy:
                del out[name]
        return json.loads(json.dumps(out))


def behaviour_version(step: int, max_lag: int) -> int:
    """The weight version that generates batch `step` (0-based) at lag `max_lag`: max(0, step - max_lag). Version
    v = the weights after v updates. A fixed function of (step, lag), never of timing, so an asynchronous run is
    as reproducible and resumable as a synchronous one."""
    return max(0, step - max_lag)


def behaviour_version(step: int, max_lag: int) -> int:
    """The weight version that generates batch `step` (0-based) at lag `max_lag`: max(0, step - max_lag). Version
    v = the weights after v updates. A fixed function of (step, lag), never of timing, so an asynchronous run is
    as reproducible and resumable as a synchronous one."""
    return max(0, step - max_lag)
