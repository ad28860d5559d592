"""Generated Countdown completions for the TinyZero parity tests: ordinary answers and an adversarial mix.

Each item is (numbers, target, completion), deterministic in the seed.
"""

from __future__ import annotations

import random
from fractions import Fraction

OPS = "+-*/"


def _random_expression(rng: random.Random, numbers) -> tuple[str, Fraction | None]:
    """A random expression using every number once (random tree, operators, spacing and parentheses) and its
    exact value (None after a division by zero)."""
    parts = [(str(n), Fraction(n)) for n in rng.sample(list(numbers), len(numbers))]
    while len(parts) > 1:
        i = rng.randrange(len(parts) - 1)
        op = rng.choice(OPS)
        sep = rng.choice(["", "", " "])
        (left, a), (right, b) = parts[i], parts[i + 1]
        joined = f"{left}{sep}{op}{sep}{right}"
        if a is None or b is None or (op == "/" and b == 0):
            value = None
        else:
            value = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b}[op]()
        if rng.random() < 0.6 or op in "+-":  # parenthesised, or kept safe to splice into a product
            joined = f"({joined})"
        parts[i:i + 2] = [(joined, value)]
    text, value = parts[0]
    if rng.random() < 0.1:
        text, value = f"-({text})", None if value is None else -value
    return text, value


def _numbers(rng: random.Random) -> tuple[int, ...]:
    high = rng.choice([9, 25, 99])
    return tuple(rng.randint(1, high) for _ in range(rng.randint(2, 4)))


def _wrap(rng: random.Random, answer: str) -> str:
    """An answer inside the forms a model writes: bare, with reasoning before, tags repeated, a newline..."""
    form = rng.randrange(10)
    if form == 0:
        return f"<answer>{answer}</answer>"
    if form == 1:
        return f"Let me try {rng.randint(1, 99)}+{rng.randint(1, 99)}.\n<answer>{answer}</answer>"
    if form == 2:
        return f"<answer>{rng.randint(1, 9)}*{rng.randint(1, 9)}</answer> no: <answer>{answer}</answer>"
    if form == 3:
        return f"<answer>{answer}</answer> <answer>{rng.randint(1, 9)}</answer>"
    if form == 4:
        return f"<answer>{answer}</answer>\n"  # TinyZero reads the (empty) last line: no answer
    if form == 5:
        return f"<answer>{answer}"  # never closed
    if form == 6:
        return f"<answer> {answer} </answer><eos>"
    if form == 7:
        return f"{answer}"
    if form == 8:
        return f"<answer>{answer}</answer>\n<answer>{rng.randint(1, 9)}</answer>"
    return f"<answer>{answer}=</answer>"


def ordinary(n: int, seed: int):
    """Completions a policy writes: right and wrong expressions over the right, missing, repeated or extra
    numbers, in the usual wrappings; 2..4 numbers up to 9, 25 or 99."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        numbers = _numbers(rng)
        text, value = _random_expression(rng, numbers)
        kind = rng.randrange(6)
        if kind <= 1 and value is not None and value.denominator == 1:  # right (the target is its value)
            target = int(value)
            if kind == 1:
                text = text.replace("(", "( ").replace("*", " * ")
        else:
            target = rng.randint(1, 999)
            if kind == 2 and len(numbers) > 1:  # a number missing
                text, _ = _random_expression(rng, numbers[:-1])
            elif kind == 3:  # a number used twice
                text, _ = _random_expression(rng, numbers + (rng.choice(numbers),))
            elif kind == 4:  # a number that is not given
                text, _ = _random_expression(rng, numbers[:-1] + (rng.randint(1, 99),))
        out.append((numbers, target, _wrap(rng, text)))
    return out


_HOSTILE_PIECES = [
    "0", "1", "2", "5", "7", "9", "00", "052", "007", "12", "84", ".", "..", ".5", "5.", "7.0", "73.0",
    "+", "-", "*", "/", "**", "//", "(", ")", "((", "))", " ", "\t", "\f", "\r", "\v", "\x1c", "\x1f", "\x00",
    "\x85", "\xa0", "\u2003", "\u3000", "\u2028", "\n", "\u0663", "\uff17", "\u00b2", "x", "=", ",", "e", "j",
    "_", "<answer>", "</answer>", "<answer", "answer>", "Assistant:", "\u00e9",
]


def _mutate(rng: random.Random, text: str) -> str:
    """Insert, delete or replace a few characters or hostile pieces."""
    for _ in range(rng.randint(1, 3)):
        i = rng.randint(0, len(text))
        action = rng.randrange(3)
        if action == 0:
            text = text[:i] + rng.choice(_HOSTILE_PIECES) + text[i:]
        elif action == 1 and text:
            text = text[:i] + text[i + 1:]
        else:
            text = text[:i] + rng.choice(_HOSTILE_PIECES) + text[i + 1:]
    return text


def _exploit(rng: random.Random):
    """Answers built to hit TinyZero's exploitable spots (right multiset, `eval` says right) and its limits."""
    kind = rng.randrange(9)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    if kind == 0:  # power
        return (a, b, c), a ** b * c, f"<answer>{a}**{b}*{c}</answer>"
    if kind == 1:  # floor division
        return (a, b, c), a * c // b, f"<answer>{a}*{c}//{b}</answer>"
    if kind == 2:  # a glued literal: 84.5*4 reads as the numbers 84, 5 and 4
        x = rng.randint(10, 99)
        return (x, 5, 4), 4 * x + 2, f"<answer>{x}.5*4</answer>"
    if kind == 3:  # a leading-dot literal turns 5 into 0.5
        return (5, a, b), a * b // 2, f"<answer>.5*{a}*{b}</answer>"
    if kind == 4:  # 12-digit numbers, float rounding across the tolerance
        big = rng.randint(10 ** 11, 10 ** 12 - 1)
        return (big, 3, 100000), big, f"<answer>{big}+3/100000</answer>"
    if kind == 5:  # long but valid
        return (a, b, c), a * b - c, "<answer>" + f"{a}*{b}{' ' * rng.randint(150, 260)}-{c}" + "</answer>"
    if kind == 6:  # deep but valid
        d = rng.randint(20, 60)
        return (a, b, c), a * b - c, "<answer>" + "(" * d + f"{a}*{b}-{c}" + ")" * d + "</answer>"
    if kind == 7:  # long literal with leading zeros read as a float by Python
        z = rng.randint(8, 16)
        return (a, b, c), a * b - c, f"<answer>{'0' * z}{a}.*{b}-{c}</answer>"
    e = rng.randint(10, 99)  # power towers: TinyZero's eval never returns
    return (a, b, e, c), 1, f"<answer>{a}**{b}**{e}*{c}</answer>"


def adversarial(n: int, seed: int):
    """A hostile mix: mutated ordinary completions, random strings over a hostile alphabet, and answers built to
    hit TinyZero's exploitable spots and limits."""
    rng = random.Random(seed)
    base = ordinary(max(n // 4, 1), seed + 7)
    out = []
    while len(out) < n:
        kind = rng.randrange(4)
        if kind == 0:
            numbers, target, text = rng.choice(base)
            out.append((numbers, target, _mutate(rng, text)))
        elif kind == 1:
            numbers, target, text = rng.choice(base)
            body = "".join(rng.choice(_HOSTILE_PIECES) for _ in range(rng.randint(1, 12)))
            out.append((numbers, target, f"<answer>{body}</answer>" if rng.random() < 0.8 else body))
        elif kind == 2:
            out.append(_exploit(rng))
        else:
            numbers, target, text = rng.choice(base)
            out.append((numbers, target, _mutate(rng, _mutate(rng, text))))
    return out
