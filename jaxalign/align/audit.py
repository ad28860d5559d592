"""Precision audit: lower the programs jaxalign compiles and find every matrix product whose precision or
accumulation is left to the backend.

A product is explicit when its StableHLO states `precision = [HIGHEST, HIGHEST]` or an `algorithm`, and, when
both operands are low precision (bf16/f16), when its result type is wider (float32 accumulation) or an algorithm
names the accumulation. Anything else is computed however the backend likes: DEFAULT is one bf16 pass on a TPU
and TF32 on an Ampere/Hopper GPU. Lowering is enough (nothing is compiled), so the audit is cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxalign.engine.engine import cast_state
from jaxalign.engine.kernels import run_continuous, run_static
from jaxalign.model.scoring import jitted_forward, sequence_logprobs
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.sampling import SamplingParams

LOW_PRECISION = ("bf16", "f16")
_PRODUCT = re.compile(r"=\s*(?:stablehlo|chlo|mhlo)\.(dot_general|dot|ragged_dot)\b")
_TENSOR = re.compile(r"tensor<([^>]*)>")


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product of a lowered program."""

    program: str
    op: str
    operand_types: tuple[str, ...]
    result_type: str
    precision: tuple[str, ...]
    algorithm: bool

    @property
    def problem(self) -> str | None:
        """Why the backend decides this product's numerics, or None when the program states them."""
        if not self.algorithm and not (self.precision and all(p == "HIGHEST" for p in self.precision)):
            shown = ", ".join(self.precision) or "none"
            return f"precision left to the backend ([{shown}], no algorithm)"
        if (not self.algorithm and self.operand_types and all(t in LOW_PRECISION for t in self.operand_types)
                and self.result_type in LOW_PRECISION):
            return f"accumulation left to the backend ({'x'.join(self.operand_types)} -> {self.result_type})"
        return None

    def describe(self) -> str:
        """One line: program, op, types, precision."""
        how = "algorithm" if self.algorithm else f"precision [{', '.join(self.precision)}]"
        return f"{self.program}: {self.op} ({', '.join(self.operand_types)}) -> {self.result_type}, {how}"


def _element_type(tensor_body: str) -> str:
    return tensor_body.split("x")[-1].strip()


def _precision(line: str) -> tuple[str, ...]:
    match = re.search(r"precision(?:_config)?\s*=\s*\[([^\]]*)\]", line)
    if not match:
        return ()
    return tuple(re.sub(r"#\w+<precision\s*|>", "", p).strip() for p in match.group(1).split(",") if p.strip())


def products(text: str, program: str = "program") -> list[Product]:
    """Every matrix product in a StableHLO module's text."""
    found = []
    for line in text.splitlines():
        match = _PRODUCT.search(line)
        if not match:
            continue
        signature = line[line.rindex(" : "):] if " : " in line else ""
        lhs, _, rhs = signature.partition("->")
        operands = tuple(_element_type(t) for t in _TENSOR.findall(lhs))
        results = [_element_type(t) for t in _TENSOR.findall(rhs)]
        if match.group(1) == "ragged_dot":
            operands = operands[:2]  # the third operand is the group sizes
        found.append(Product(program, match.group(1), operands, results[0] if results else "?",
                             _precision(line), "algorithm" in line))
    return found


def audit(texts: dict[str, str]) -> dict:
    """Audit lowered programs {name: StableHLO text}: {"products": n, "per_program": {name: n},
    "problems": [description + reason, ...]}."""
    per_program, problems = {}, []
    for name, text in texts.items():
        found = products(text, name)
        per_program[name] = len(found)
        problems += [f"{p.describe()}: {p.problem}" for p in found if p.problem]
    return {"products": sum(per_program.values()), "per_program": per_program, "problems": problems}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


PROGRAMS = ("forward", "gradient", "engine", "engine-chunked-prefill", "engine-continuous")


def lower_programs(model, policy: NumericPolicy, programs=PROGRAMS, *, batch: int = 2, seq: int = 8,
                   max_new: int = 4, prefill_chunk: int = 4) -> dict[str, str]:
    """StableHLO text of the programs a model runs under `policy` (a subset of `PROGRAMS`): the trainer's forward
    (scoring) and gradient, and the engine's static batch (prefill + decode loop), its chunked prefill and its
    continuous batching. Abstract inputs; lowered, not compiled."""
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"unknown programs {sorted(unknown)}; allowed: {', '.join(PROGRAMS)}")
    graphdef, state = nnx.split(model)
    state = _abstract(state)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def loss(s, t):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, s), t, policy)[0])

    engine_state = jax.eval_shape(functools.partial(cast_state, policy=policy), state)
    ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    sampling = dict(policy=policy, cache_len=seq + max_new, sampling=SamplingParams(temperature=1.0))
    seed, max_new_tokens, eos_id = scalar, scalar, scalar
    engine_args = (graphdef, engine_state, tokens, ints, ints, seed, max_new_tokens, eos_id)
    lower = {
        "forward": lambda: jitted_forward.lower(graphdef, state, tokens, None, None, policy=policy),
        "gradient": lambda: jax.jit(jax.grad(loss)).lower(state, tokens),
        "engine": lambda: run_static.lower(*engine_args, prefill_chunk=None, **sampling),
        "engine-chunked-prefill": lambda: run_static.lower(*engine_args, prefill_chunk=prefill_chunk, **sampling),
        "engine-continuous": lambda: run_continuous.lower(*engine_args, slots=batch, **sampling),
    }
    return {name: lower[name]().as_text() for name in programs}
