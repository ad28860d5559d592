"""Countdown (as in TinyZero): reach a target with + - * / and parentheses, using each given number once.

`generate_problems` builds solvable problems by construction (a random expression over the numbers defines the
target). `score` reproduces TinyZero's verdicts with a safe parser and exact rational arithmetic -- no `eval`,
and bounded work on any input.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from fractions import Fraction

FORMAT_SCORE = 0.1
MAX_EXPRESSION_CHARS = 200
MAX_LITERAL_DIGITS = 12
MAX_DEPTH = 32
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Numbers to combine and the target to reach; `solution` is one expression that reaches it."""

    numbers: tuple[int, ...]
    target: int
    solution: str

    def prompt(self) -> str:
        """The prompt text: numbers, an arrow and the target, then the opening answer tag."""
        return f"{','.join(map(str, self.numbers))}={self.target}:<answer>"


def _expressions(values: list[tuple[Fraction, str]]):
    """Every (value, text) reachable by combining all `values` with + - * / (binary trees, any order)."""
    if len(values) == 1:
        yield values[0]
        return
    for i, j in itertools.permutations(range(len(values)), 2):
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        (a, sa), (b, sb) = values[i], values[j]
        candidates = [(a + b, f"({sa}+{sb})"), (a - b, f"({sa}-{sb})"), (a * b, f"({sa}*{sb})")]
        if b != 0:
            candidates.append((a / b, f"({sa}/{sb})"))
        for c in candidates:
            yield from _expressions(rest + [c])


def _strip_outer(text: str) -> str:
    return text[1:-1] if text.startswith("(") and text.endswith(")") and _balanced(text[1:-1]) else text


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0


def solve(numbers, target) -> str | None:
    """One expression using every number once that equals `target` exactly, or None (brute force)."""
    for value, text in _expressions([(Fraction(n), str(n)) for n in numbers]):
        if value == target:
            return _strip_outer(text)
    return None


def generate_problems(n: int, seed: int, *, count=(3, 3), low: int = 1, high: int = 9,
                      max_target: int = 99) -> list[Problem]:
    """`n` solvable problems with `count` (min, max) numbers in [low, high] and integer targets in
    [1, max_target]; deterministic in `seed`."""
    if not 2 <= count[0] <= count[1] <= 4 or low < 0 or high < low:
        raise ValueError(f"count {count} must be within 2..4 and low <= high (got low={low}, high={high})")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        numbers = tuple(rng.randint(low, high) for _ in range(rng.randint(*count)))
        values = [v for v, _ in _expressions([(Fraction(x), "") for x in numbers])]
        targets = sorted({int(v) for v in values if v.denominator == 1 and 1 <= v <= max_target})
        if not targets:
            continue
        target = rng.choice(targets)
        out.append(Problem(numbers, target, solve(numbers, target)))
    return out


class _Parser:
    """Recursive-descent parser for + - * / ( ) over non-negative decimal literals, evaluated exactly."""

    def __init__(self, text: str):
        self.tokens = re.findall(r"\d+(?:\.\d+)?|\.\d+|[+\-*/()]", text)
        self.pos = 0
        self.literals: list[Fraction] = []

    def parse(self) -> Fraction:
        value = self._sum(0)
        if self.pos != len(self.tokens):
            raise ValueError("trailing input")
        return value

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _sum(self, depth):
        value = self._product(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._product(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _product(self, depth):
        value = self._unary(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._unary(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ZeroDivisionError
            else:
                value = value / rhs
        return value

    def _unary(self, depth):
        if depth > MAX_DEPTH:
            raise ValueError("nesting too deep")
        tok = self._peek()
        if tok == "-":
            self.pos += 1
            return -self._unary(depth + 1)
        if tok == "+":
            self.pos += 1
            return self._unary(depth + 1)
        if tok == "(":
            self.pos += 1
            value = self._sum(depth + 1)
            if self._peek() != ")":
                raise ValueError("unbalanced parentheses")
            self.pos += 1
            return value
        if tok is None or tok in "+-*/)":
            raise ValueError("expected a number")
        self.pos += 1
        if len(tok.replace(".", "")) > MAX_LITERAL_DIGITS:
            raise ValueError("literal too long")
        value = Fraction(tok)
        self.literals.append(value)
        return value


def extract_answer(completion: str) -> str | None:
    """The text inside the last <answer>...</answer> pair (TinyZero takes the last), or None."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def score(numbers, target, completion: str, *, format_score: float = FORMAT_SCORE) -> float:
    """TinyZero's reward: no answer 0; wrong number multiset, bad characters or unparsable -> `format_score`;
    value within 1e-5 of the target 1.0, else `format_score`."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if len(answer) > MAX_EXPRESSION_CHARS or not _ALLOWED.match(answer):
        return format_score
    parser = _Parser(answer)
    try:
        value = parser.parse()
    except (ValueError, ZeroDivisionError):
        return format_score
    if sorted(parser.literals) != sorted(Fraction(n) for n in numbers):
        return format_score
    return 1.0 if abs(value - Fraction(target)) < Fraction(1, 100000) else format_score
