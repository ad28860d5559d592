"""Countdown (as in TinyZero): reach a target with + - * / and parentheses, using each given number once.

`generate_problems` builds solvable problems by construction (a random expression over the numbers defines the
target). `score` gives TinyZero's verdicts (`verl/utils/reward_score/countdown.py`, `compute_score`, which
`eval`s the answer) with a lexer that follows Python's for the characters TinyZero lets through, a
recursive-descent parser and exact rational arithmetic -- no `eval`, and time linear in the completion's length
whatever the input.

What is TinyZero's, followed exactly (tests/test_countdown_parity.py measures it on generated completions):
- the completion is the text after TinyZero's "Assistant:" marker; only its last line (after the last `\n`)
  is read, and in it the last of the non-overlapping `<answer>...</answer>` pairs, stripped; none -> 0.0;
- numbers: the digit runs of the answer must be the given numbers as a multiset;
- literals as Python reads them: `7.` is 7, `00` is 0, `052` is a syntax error (0.1) but `052.` is 52;
- whitespace as Python reads it inside one line: space, tab and form feed anywhere, a carriage return only
  inside parentheses (Python's implicit line joining); any other whitespace or control character, and any
  non-ASCII digit, is a syntax error (0.1);
- a value within 1e-5 (the double 1e-5) of the target scores 1.0, anything else that was extracted 0.1.

Deliberate differences (each pinned by a test; TinyZero's verdict differs only on these):
- `**` (power) and `//` (floor division) are not Countdown operators: 0.1 here; TinyZero evaluates them, so
  `2**3*1` scores 1.0 for target 8 there, and `9**9**9**9` never returns.
- A literal with a fraction part (`84.5`, `.5`, `5.0`): 0.1 here. TinyZero reads its digit runs as separate
  numbers, so `84.5*4` uses the numbers {84, 5, 4} and scores 1.0 for target 338, and `.5` turns 5 into 0.5.
  (`73.0` agrees: its digit runs 73 and 0 are not the numbers unless 0 is one of them.)
- Exact rational arithmetic: TinyZero divides in floating point, so with 12-digit numbers rounding can move a
  result across the 1e-5 tolerance (`999999999999+3/100000` "equals" 999999999999 there).
- Guards: answers over MAX_EXPRESSION_CHARS characters, literals over MAX_LITERAL_DIGITS digits and nesting
  (parentheses plus unary signs) deeper than MAX_DEPTH score 0.1 here; TinyZero has no such limits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import random
import re
from fractions import Fraction

FORMAT_SCORE = 0.1
MAX_EXPRESSION_CHARS = 200
MAX_LITERAL_DIGITS = 12
MAX_DEPTH = 32
OPEN, CLOSE = "<answer>", "</answer>"
_LITERAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")  # Python's decimal literals, ASCII digits only
_ZEROS = re.compile(r"0+")
_ONE_LINE_SPACE = " \t\f"  # what Python's tokenizer skips inside a line
TOLERANCE = Fraction(1e-5)  # TinyZero compares against the double 1e-5, slightly above 1/100000


@dataclasses.dataclass(frozen=True)
class Problem:
    """Numbers to combine and the target to reach; `solution` is one expression that reaches it."""

    numbers: tuple[int, ...]
    target: int
    solution: str

    def prompt(self, answer_format: str = "bare") -> str:
        """The prompt text: numbers, `=` and the target, `:`, then (`bare`) the opening answer tag; in the `steps`
        format the completion writes its worked steps before opening the tag itself."""
        check_answer_format(answer_format)
        head = f"{','.join(map(str, self.numbers))}={self.target}:"
        return head + OPEN if answer_format == "bare" else head


# How a completion is laid out (`completion_text`): `bare` = the expression and the closing tag (the prompt opened
# it); `steps` = the worked steps, each operation with its value ("3+5=8 8*7=56"), then the answer in its tags
# ("3+5=8 8*7=56 <answer>(3+5)*7</answer>"), as a reasoning trace before TinyZero's answer. The reward reads the
# answer only (TinyZero's), so the steps are the model's own business, as its <think> is in TinyZero.
ANSWER_FORMATS = ("bare", "steps")


def check_answer_format(answer_format: str) -> None:
    """A clear error for an unknown answer format."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format = {answer_format!r}; allowed: {', '.join(ANSWER_FORMATS)}")


# Which targets a problem may have (`generate_problems`, `held_out_problems`): `any` = every integer some expression
# over the numbers reaches (TinyZero's draw); `chain` = those reached by combining the numbers left to right in the
# order shown, ((a op b) op c) op d, with integer intermediate values -- still scored as any Countdown answer (any
# expression reaching the target is right), but with a solution a small model can find one operator at a time, as
# the two-number task's. The 2-layer study model finds no 3-4-number solution of `any` targets often enough for
# RL to have a signal (docs/lowbit.md, "Choosing the task").
TARGET_KINDS = ("any", "chain")
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def check_target_kind(targets: str) -> None:
    """A clear error for an unknown target kind."""
    if targets not in TARGET_KINDS:
        raise ValueError(f"targets = {targets!r}; allowed: {', '.join(TARGET_KINDS)}")


@functools.lru_cache(maxsize=65536)
def chain_solutions(numbers: tuple[int, ...]) -> dict:
    """{target: expression} for every integer target >= 1 that `numbers`, combined left to right in the order
    given with integer intermediate values, reach; the expression is the first such chain in operator order
    + - * / (e.g. (3, 5, 7) -> {..., 56: "(3+5)*7", ...}; a division must come out whole)."""
    out: dict[int, str] = {}
    for ops in itertools.product("+-*/", repeat=len(numbers) - 1):
        value, text = Fraction(numbers[0]), str(numbers[0])
        for op, n in zip(ops, numbers[1:]):
            if op == "/" and n == 0:
                break
            value = _OPERATIONS[op](value, n)
            if value.denominator != 1:
                break
            text = f"({text}{op}{n})"
        else:
            if value >= 1 and int(value) not in out:
                out[int(value)] = _strip_outer(text)
    return out


def _targets(numbers, max_target: int, targets: str) -> list[int]:
    if targets == "chain":
        return sorted(t for t in chain_solutions(tuple(numbers)) if t <= max_target)
    return reachable_targets(numbers, max_target)


def _value_text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def worked_steps(expression: str) -> str:
    """The operations of `expression` in the order they are evaluated, each as `a op b=c` (values exact: a
    fraction as `p/q`), space-separated: "(3+5)*7" -> "3+5=8 8*7=56"; "" for a single number."""
    parser = _Parser(expression)
    parser.parse()
    return " ".join(f"{_value_text(a)}{op}{_value_text(b)}={_value_text(c)}" for a, op, b, c in parser.steps)


def completion_text(expression: str, answer_format: str = "bare") -> str:
    """What a completion answering `expression` looks like in `answer_format` (see ANSWER_FORMATS)."""
    check_answer_format(answer_format)
    if answer_format == "bare":
        return expression + CLOSE
    steps = worked_steps(expression)
    return f"{steps} {OPEN}{expression}{CLOSE}" if steps else f"{OPEN}{expression}{CLOSE}"


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
                      max_target: int = 99, held_out: float = 0.0, targets: str = "any") -> list[Problem]:
    """`n` solvable problems with `count` (min, max) numbers in [low, high] and integer targets in
    [1, max_target] of the kind `targets` (TARGET_KINDS); deterministic in `seed`. With `held_out` > 0, problems
    of the held-out split (`is_held_out`) are never drawn: they belong to evaluation."""
    check_ranges(count, low, high)
    check_target_kind(targets)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        numbers = tuple(rng.randint(low, high) for _ in range(rng.randint(*count)))
        candidates = _targets(numbers, max_target, targets)
        if not candidates:
            continue
        target = rng.choice(candidates)
        if held_out and is_held_out(numbers, target, held_out):
            continue
        solution = chain_solutions(numbers)[target] if targets == "chain" else solve(numbers, target)
        out.append(Problem(numbers, target, solution))
    return out


def check_ranges(count, low: int, high: int) -> None:
    """ValueError unless 2 <= count[0] <= count[1] <= 4 and 0 <= low <= high."""
    if not 2 <= count[0] <= count[1] <= 4 or low < 0 or high < low:
        raise ValueError(f"count {count} must be within 2..4 and low <= high (got low={low}, high={high})")


def reachable_targets(numbers, max_target: int) -> list[int]:
    """The integer targets in [1, max_target] that some expression over all of `numbers` reaches, sorted."""
    values = _values(tuple(sorted(numbers)))
    return sorted({int(v) for v in values if v.denominator == 1 and 1 <= v <= max_target})


@functools.lru_cache(maxsize=65536)
def _values(numbers: tuple[int, ...]) -> frozenset:
    """Every value of an expression using each of `numbers` (sorted) once with + - * /: the root of any such
    expression splits the numbers into two non-empty parts, so the values are those of every split's two sides
    combined (the same set `_expressions` enumerates, memoised on the sorted numbers)."""
    if len(numbers) == 1:
        return frozenset({Fraction(numbers[0])})
    out = set()
    n = len(numbers)
    for mask in range(1, 2 ** (n - 1)):  # the last number always on the right: each split once
        left = tuple(numbers[i] for i in range(n) if mask >> i & 1)
        right = tuple(numbers[i] for i in range(n) if not mask >> i & 1)
        for a in _values(left):
            for b in _values(right):
                out.update((a + b, a - b, b - a, a * b))
                if b:
                    out.add(a / b)
                if a:
                    out.add(b / a)
    return frozenset(out)


def is_held_out(numbers, target: int, fraction: float) -> bool:
    """Whether the problem (the multiset of `numbers`, `target`) lies in the held-out split holding `fraction` of
    all problems: a hash of the sorted numbers and the target, so a problem and its reorderings fall on the same
    side, on every host and Python (sha256, not `hash`)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction {fraction}; allowed: 0 <= fraction < 1")
    key = ",".join(map(str, sorted(numbers))) + f"={target}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") < fraction * 2.0 ** 64


MAX_ENUMERATED = 20_000  # number multisets enumerated for a held-out split; larger spaces are sampled


def held_out_problems(fraction: float, *, count=(3, 3), low: int = 1, high: int = 9, max_target: int = 99,
                      limit: int | None = None, targets: str = "any") -> list[Problem]:
    """The held-out split's problems (`is_held_out`), in a fixed pseudo-random order (numbers shuffled within each
    problem, as training draws them); all of them, or the first `limit`. Spaces of more than `MAX_ENUMERATED`
    number multisets are sampled instead (seeded; `limit` distinct problems, required then)."""
    check_ranges(count, low, high)
    check_target_kind(targets)
    if fraction <= 0:
        raise ValueError(f"held-out fraction {fraction}; allowed: > 0 for a held-out split")
    sizes = [math.comb(high - low + k, k) for k in range(count[0], count[1] + 1)]
    found = {}
    if sum(sizes) <= MAX_ENUMERATED:
        for k in range(count[0], count[1] + 1):
            for numbers in itertools.combinations_with_replacement(range(low, high + 1), k):
                for target in _multiset_targets(numbers, max_target, targets):
                    if is_held_out(numbers, target, fraction):
                        found[(numbers, target)] = None
    else:
        if limit is None:
            raise ValueError(f"the problem space has {sum(sizes)} number multisets (> {MAX_ENUMERATED}); give a "
                             f"limit to sample the held-out split")
        rng, tries = random.Random(0), 0
        while len(found) < limit and tries < 10_000 * limit:
            tries += 1
            numbers = tuple(sorted(rng.randint(low, high) for _ in range(rng.randint(*count))))
            candidates = _multiset_targets(numbers, max_target, targets)
            if candidates:
                target = rng.choice(candidates)
                if is_held_out(numbers, target, fraction):
                    found[(numbers, target)] = None
    keys = sorted(found, key=lambda key: hashlib.sha256(repr(key).encode()).digest())
    out = []
    for numbers, target in keys[:limit]:
        shuffle = random.Random(repr((numbers, target))).shuffle
        if targets == "chain":  # shown in an order whose chain reaches the target (the first of them, shuffled)
            orders = sorted(p for p in set(itertools.permutations(numbers)) if target in chain_solutions(p))
            shuffle(orders)
            out.append(Problem(orders[0], target, chain_solutions(orders[0])[target]))
        else:
            order = list(numbers)
            shuffle(order)
            out.append(Problem(tuple(order), target, solve(order, target)))
    return out


def _multiset_targets(numbers: tuple[int, ...], max_target: int, targets: str) -> list[int]:
    """The targets of the kind `targets` a problem over the multiset `numbers` may have (for `chain`: in some
    order of the numbers)."""
    if targets == "chain":
        return sorted({t for p in set(itertools.permutations(numbers)) for t in chain_solutions(p) if t <= max_target})
    return reachable_targets(numbers, max_target)


class _Reject(ValueError):
    """The answer is not an expression this scorer accepts (TinyZero would give the format score too, except for
    the deliberate differences in the module docstring)."""


def _tokens(text: str) -> list[str]:
    """Python's tokens for an expression over `+ - * / ( )` and decimal literals; `_Reject` on anything else.

    Literals with a fraction part, integer literals with leading zeros and literals over MAX_LITERAL_DIGITS digits
    are refused here; `**` and `//` come out as single tokens (which the parser refuses)."""
    out, i, depth, n = [], 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch in _ONE_LINE_SPACE or (ch == "\r" and depth > 0):
            i += 1
            continue
        if ch in "0123456789.":
            match = _LITERAL.match(text, i)
            if match is None:
                raise _Reject(f"stray '.' at {i}")
            tok = match.group()
            if "." in tok and not tok.endswith("."):
                raise _Reject(f"literal {tok!r} has a fraction part")
            digits = tok.rstrip(".")
            if "." not in tok and len(digits) > 1 and digits[0] == "0" and not _ZEROS.fullmatch(digits):
                raise _Reject(f"integer literal {tok!r} has leading zeros")
            if len(digits) > MAX_LITERAL_DIGITS:
                raise _Reject("literal too long")
            out.append(tok)
            i = match.end()
            continue
        if ch in "*/" and text.startswith(ch * 2, i):
            out.append(ch * 2)
            i += 2
            continue
        if ch in "+-*/()":
            depth += {"(": 1, ")": -1}.get(ch, 0)
            out.append(ch)
            i += 1
            continue
        raise _Reject(f"character {ch!r} at {i}")
    return out


class _Parser:
    """Recursive-descent parser for + - * / ( ) and unary signs over `_tokens`, evaluated exactly."""

    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.pos = 0
        self.literals: list[int] = []
        self.steps: list[tuple[Fraction, str, Fraction, Fraction]] = []  # (a, op, b, a op b) in evaluation order

    def parse(self) -> Fraction:
        value = self._sum(0)
        if self.pos != len(self.tokens):
            raise _Reject("trailing input")
        return value

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _sum(self, depth):
        value = self._product(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._product(depth)
            result = value + rhs if op == "+" else value - rhs
            self.steps.append((value, op, rhs, result))
            value = result
        return value

    def _product(self, depth):
        value = self._unary(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._unary(depth)
            if op == "*":
                result = value * rhs
            elif rhs == 0:
                raise ZeroDivisionError
            else:
                result = value / rhs
            self.steps.append((value, op, rhs, result))
            value = result
        return value

    def _unary(self, depth):
        if depth > MAX_DEPTH:
            raise _Reject("nesting too deep")
        tok = self._peek()
        if tok in ("-", "+"):
            self.pos += 1
            value = self._unary(depth + 1)
            return -value if tok == "-" else value
        if tok == "(":
            self.pos += 1
            value = self._sum(depth + 1)
            if self._peek() != ")":
                raise _Reject("unbalanced parentheses")
            self.pos += 1
            return value
        if tok is None or tok[0] not in "0123456789.":
            raise _Reject(f"expected a number, got {tok!r}")
        self.pos += 1
        value = int(tok.rstrip("."))
        self.literals.append(value)
        return Fraction(value)


def extract_answer(completion: str) -> str | None:
    """TinyZero's answer: in the last line of `completion`, the last of the non-overlapping `<answer>...</answer>`
    pairs found left to right (what `re.finditer(r"<answer>(.*?)</answer>")` yields), stripped; None if none.

    Linear time: each `find` starts where the previous one stopped (the regex is quadratic in unclosed tags)."""
    line_start = completion.rfind("\n") + 1
    found, pos = None, line_start
    while True:
        opening = completion.find(OPEN, pos)
        if opening < 0:
            break
        closing = completion.find(CLOSE, opening + len(OPEN))
        if closing < 0:  # no closing after this opening, hence none after any later one
            break
        found, pos = (opening + len(OPEN), closing), closing + len(CLOSE)
    return None if found is None else completion[found[0]:found[1]].strip()


def score(numbers, target, completion: str, *, format_score: float = FORMAT_SCORE) -> float:
    """TinyZero's reward for `completion` (the text after the assistant marker): no answer 0.0; an answer whose
    numbers are not `numbers` (as a multiset), that does not parse or divides by zero -> `format_score`; a value
    within 1e-5 of `target` 1.0, else `format_score`. Deliberate differences: module docstring."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if len(answer) > MAX_EXPRESSION_CHARS:
        return format_score
    try:
        parser = _Parser(answer)
        value = parser.parse()
    except (_Reject, ZeroDivisionError):
        return format_score
    if sorted(parser.literals) != sorted(numbers):
        return format_score
    return 1.0 if abs(value - Fraction(target)) < TOLERANCE else format_score
