"""TinyZero's Countdown reward, re-implemented from its documented behaviour for the parity tests (not its code).

TinyZero (`verl/utils/reward_score/countdown.py`, `compute_score`) takes the text after "Assistant:", keeps its
last line, takes the last `re.finditer(r"<answer>(.*?)</answer>")` match, strips it; none -> 0. Then: the
answer's `\\d+` runs, as ints, must equal the numbers as a multiset, the answer must match
`^[\\d+\\-*/().\\s]+$`, and Python's `eval` of it must come within 1e-5 of the target (1.0); anything else that
was extracted scores the format score. `eval` is emulated here with `ast.parse` (Python's own tokenizer and
parser, so the same syntax verdicts) and a walk of the tree with Python's int/float operators; a power whose
result would be astronomically large is reported as HANG instead of computed (TinyZero's `eval` would not return).

`deliberate_score` is the same reference with the scorer's listed deliberate differences applied, reporting
which of them fired: the parity tests check that jaxalign's scorer equals it everywhere, which leaves the listed
differences as the only possible disagreements with TinyZero.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

HANG = "hang"
FORMAT_SCORE = 0.1
_ANSWER = re.compile(r"<answer>(.*?)</answer>")
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_POW_BITS_LIMIT = 100_000  # a power beyond this many bits stands for "eval never returns"


class _Hang(Exception):
    pass


def answer_of(completion: str) -> str | None:
    """TinyZero's extraction for a completion that follows its "Assistant:" marker."""
    line = ("Assistant:" + completion).split("Assistant:", 1)[1].split("\n")[-1]
    matches = list(_ANSWER.finditer(line))
    return matches[-1].group(1).strip() if matches else None


def _numbers_match(answer: str, numbers) -> bool:
    try:
        return sorted(int(run) for run in re.findall(r"\d+", answer)) == sorted(numbers)
    except ValueError:  # a digit run beyond Python's int-from-string limit
        return False


def _power(base, exponent):
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > _POW_BITS_LIMIT:
            raise _Hang
    return base ** exponent


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Pow: _power,
           ast.Mod: lambda a, b: a % b}


def _evaluate(node, exact: bool):
    """Python's value of an expression tree (exact=True: literals and operators over Fractions instead)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value) if exact else node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, exact)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, exact), _evaluate(node.right, exact)
        return _BINARY[type(node.op)](left, right)
    for child in ast.iter_child_nodes(node):  # e.g. `5(3)`: eval evaluates the parts, then the call fails
        _evaluate(child, exact)
    raise TypeError(f"{type(node).__name__} is not a number")


def _parse(answer: str):
    if not _ALLOWED.match(answer):
        return None
    try:
        return ast.parse(answer, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _verdict(tree, target, exact: bool, format_score: float):
    try:
        result = _evaluate(tree, exact)
    except _Hang:
        return HANG
    except (ArithmeticError, TypeError, ValueError):
        return format_score
    try:
        return 1.0 if abs(result - target) < (Fraction(1e-5) if exact else 1e-5) else format_score
    except TypeError:
        return format_score


def tinyzero_score(numbers, target, completion: str, format_score: float = FORMAT_SCORE):
    """TinyZero's `compute_score` verdict: 0, `format_score`, 1.0, or HANG where its eval would not return."""
    answer = answer_of(completion)
    if answer is None:
        return 0.0
    if not _numbers_match(answer, numbers):
        return format_score
    tree = _parse(answer)
    return format_score if tree is None else _verdict(tree, target, False, format_score)


# --- the deliberate differences --------------------------------------------------------------------------------

def _line_starts(answer: str) -> list[int]:
    """Offsets where Python's lines start (the answer holds no "\\n"; a lone "\\r" ends a line)."""
    return [0] + [i + 1 for i, ch in enumerate(answer) if ch == "\r"]


def _rules_fired(answer: str, tree, max_digits: int, max_depth: int) -> list[str]:
    fired = []
    starts = _line_starts(answer)
    offset = lambda node: starts[node.lineno - 1] + node.col_offset  # noqa: E731  (ASCII once parsed)
    depth_of = {}

    def walk(node, unary):
        depth_of[node] = unary
        for child in ast.iter_child_nodes(node):
            walk(child, unary + isinstance(node, ast.UnaryOp))

    walk(tree, 0)
    deepest = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            fired.append("power **")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            fired.append("floor division //")
        if isinstance(node, ast.Constant):
            text = answer[offset(node):starts[node.end_lineno - 1] + node.end_col_offset]
            if re.search(r"\.\d", text):
                fired.append("fraction literal")
            if sum(ch.isdigit() for ch in text) > max_digits:
                fired.append("literal digits guard")
            parens = answer[:offset(node)].count("(") - answer[:offset(node)].count(")")
            deepest = max(deepest, parens + depth_of[node])
    if deepest > max_depth:
        fired.append("depth guard")
    return sorted(set(fired))


def deliberate_score(numbers, target, completion: str, *, max_chars: int, max_digits: int, max_depth: int,
                     format_score: float = FORMAT_SCORE):
    """(verdict, rules): TinyZero's verdict with the scorer's deliberate differences applied, and the names of
    the differences that changed the verdict's inputs (empty when none applies)."""
    answer = answer_of(completion)
    if answer is None:
        return 0.0, []
    if len(answer) > max_chars:
        return format_score, ["length guard"]
    if not _numbers_match(answer, numbers):
        return format_score, []
    tree = _parse(answer)
    if tree is None:
        return format_score, []
    rules = _rules_fired(answer, tree, max_digits, max_depth)
    if rules:
        return format_score, rules
    exact = _verdict(tree, target, True, format_score)
    if exact != _verdict(tree, target, False, format_score):
        return exact, ["float rounding"]
    return exact, []
