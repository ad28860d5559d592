"""PolicySchedule: different NumericPolicies for different parts of one model (used by localisation to run
"the first i layers under A, the rest under B", or "only the MoE blocks from A").

Parts are named `embed`, `layer{i}` (a whole block), `layer{i}.attn`, `layer{i}.mlp`, `attn` / `mlp` (that
module in every block) and `head` (final norm and LM head). The most specific rule wins:
`layer{i}.{module}` > `layer{i}` > `{module}` > the default.
"""

from __future__ import annotations

import dataclasses
import re

from jaxalign.numerics.policy import NumericPolicy

_PART = re.compile(r"^(embed|head|attn|mlp|layer\d+(\.(attn|mlp))?)$")


@dataclasses.dataclass(frozen=True)
class PolicySchedule:
    """A default policy plus (part, policy) rules; hashable, so it can be a static jit argument."""

    default: NumericPolicy
    rules: tuple[tuple[str, NumericPolicy], ...] = ()

    def __post_init__(self) -> None:
        for part, policy in self.rules:
            if not _PART.match(part):
                raise ValueError(f"unknown model part {part!r}; allowed: embed, head, attn, mlp, layer<i>, "
                                 f"layer<i>.attn, layer<i>.mlp")
            if not isinstance(policy, NumericPolicy):
                raise ValueError(f"rule for {part!r} must map to a NumericPolicy")

    def for_part(self, module: str, layer: int | None = None) -> NumericPolicy:
        """The policy of `module` ("embed", "attn", "mlp", "head") in `layer`."""
        table = dict(self.rules)
        keys = ([f"layer{layer}.{module}", f"layer{layer}"] if layer is not None else []) + [module]
        for key in keys:
            if key in table:
                return table[key]
        return self.default

    def __str__(self) -> str:
        return f"default: {self.default}; " + "; ".join(f"{part}: {p}" for part, p in self.rules)


def policy_for(policy: NumericPolicy | PolicySchedule, module: str, layer: int | None = None) -> NumericPolicy:
    """Resolve a plain policy or a schedule to the policy of one model part."""
    if isinstance(policy, PolicySchedule):
        return policy.for_part(module, layer)
    return policy
