"""The Countdown scorer against TinyZero's `compute_score` (re-implemented in tests/tinyzero_reference.py):
0 disagreements on ordinary completions; on an adversarial mix, the scorer equals TinyZero-with-the-listed-
deliberate-differences everywhere, so every disagreement with TinyZero is one of those differences."""

import collections

import countdown_corpus as corpus
import pytest
import tinyzero_reference as ref
from hypothesis import given, settings, strategies as st

from jaxalign.rl import countdown

GUARDS = dict(max_chars=countdown.MAX_EXPRESSION_CHARS, max_digits=countdown.MAX_LITERAL_DIGITS,
              max_depth=countdown.MAX_DEPTH)
DELIBERATE = {"power **", "floor division //", "fraction literal", "float rounding", "length guard",
              "literal digits guard", "depth guard"}
N = 20_000


def _table(items):
    """(disagreements with TinyZero by deliberate difference, items where the scorer differs from TinyZero with
    the deliberate differences applied)."""
    by_rule, unexplained = collections.Counter(), []
    for numbers, target, text in items:
        ours = countdown.score(numbers, target, text)
        expected, rules = ref.deliberate_score(numbers, target, text, **GUARDS)
        if ours != expected:
            unexplained.append((numbers, target, text, ours, expected))
        if ours != ref.tinyzero_score(numbers, target, text):
            by_rule[" + ".join(rules) or "unexplained"] += 1
    return by_rule, unexplained


def test_ordinary_completions_agree_with_tinyzero_exactly():
    items = corpus.ordinary(N, seed=0)
    verdicts = collections.Counter(ref.tinyzero_score(*item) for item in items)
    by_rule, unexplained = _table(items)
    print(f"\nordinary: {N} completions, TinyZero verdicts {dict(verdicts)}, disagreements {sum(by_rule.values())}")
    assert min(verdicts[0.0], verdicts[0.1], verdicts[1.0]) > N // 20  # every verdict well represented
    assert not by_rule and not unexplained


def test_adversarial_disagreements_are_only_the_listed_deliberate_differences():
    items = corpus.adversarial(N, seed=1)
    by_rule, unexplained = _table(items)
    total = sum(by_rule.values())
    print(f"\nadversarial: {N} completions, {total} disagreements ({100 * total / N:.1f}%):")
    for rule, count in by_rule.most_common():
        print(f"  {rule:24s} {count}")
    assert not unexplained, unexplained[:5]
    assert "unexplained" not in by_rule
    assert {r for key in by_rule for r in key.split(" + ")} == DELIBERATE  # the mix exercises every one


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["1", "5", "7", "0", "05", ".", "5.", ".5", "+", "-", "*", "/", "(", ")", " ",
                                 "\t", "\f", "\r", "\v", "\x1f", "\xa0", "\u0667", "\n", "<answer>", "</answer>"]),
                max_size=40).map("".join))
def test_random_hostile_text_matches_the_reference(text):
    expected, _ = ref.deliberate_score((1, 5, 7), 12, text, **GUARDS)
    assert countdown.score((1, 5, 7), 12, text) == expected


@pytest.mark.parametrize("numbers, target, answer, rule", [
    ((2, 3, 1), 8, "2**3*1", "power **"),
    ((9, 2, 5), 22, "9*5//2", "floor division //"),
    ((84, 5, 4), 338, "84.5*4", "fraction literal"),
    ((5, 4, 3), 6, ".5*4*3", "fraction literal"),
    ((7, 0, 5), 35, "7.0*5", "fraction literal"),
    ((999999999999, 3, 100000), 999999999999, "999999999999+3/100000", "float rounding"),
    ((7, 1, 5), 34, "7*5" + " " * 200 + "-1", "length guard"),
    ((7, 1, 5), 34, "(" * 40 + "7*5-1" + ")" * 40, "depth guard"),
    ((7, 1, 5), 34, "-" * 34 + "7*5-1", "depth guard"),
    ((7, 1, 5), 34, "0000000000007.*5-1", "literal digits guard"),
])
def test_each_deliberate_difference(numbers, target, answer, rule):
    completion = f"<answer>{answer}</answer>"
    assert ref.tinyzero_score(numbers, target, completion) == 1.0  # TinyZero is exploitable here
    assert countdown.score(numbers, target, completion) == 0.1
    assert ref.deliberate_score(numbers, target, completion, **GUARDS) == (0.1, [rule])


def test_float_rounding_also_rejects_exact_answers_in_tinyzero():
    numbers, target, completion = (149927838106, 7, 21), 449783514318, "<answer>149927838106/7*21</answer>"
    assert countdown.score(numbers, target, completion) == 1.0  # exactly the target
    assert ref.tinyzero_score(numbers, target, completion) == 0.1  # 449783514318.00006 in floating point


def test_power_towers_hang_tinyzero_and_not_the_scorer():
    completion = "<answer>9**9**99*1</answer>"
    assert ref.tinyzero_score((9, 9, 99, 1), 1, completion) == ref.HANG
    assert countdown.score((9, 9, 99, 1), 1, completion) == 0.1


@pytest.mark.parametrize("answer, expected", [
    ("(7*5-1).", 0.1),  # a stray '.' is a syntax error, not skipped
    ("7*5-1.", 1.0),  # `1.` is a float literal: 1
    ("7.*5-1", 1.0),
    ("7.0*5.0-1.0", 0.1),  # the digit runs 7 0 5 0 1 0 are not the numbers
    ("73.0-39", 0.1),
    ("7*05-1", 0.1),  # leading zeros: a syntax error in Python 3
    ("7*05.-1", 1.0),  # ... but not in a float literal
    ("7*5-1+00*0", 0.1),  # 00 is 0, but 0 is not among the numbers
    ("\u0667*5-1", 0.1),  # ARABIC-INDIC SEVEN: a digit for `\d`, not for Python
    ("7*5\xa0-1", 0.1),  # no-break space
    ("7*5\x1f-1", 0.1),  # a control character that `\s` matches
    ("7*5\v-1", 0.1),  # vertical tab
    ("7*5\t-\f1", 1.0),  # tab and form feed are Python whitespace
    ("(7*5\r-1)", 1.0),  # a carriage return inside parentheses: implicit line joining
    ("7*5\r-1", 0.1),  # ... and outside them a line break
])
def test_literal_and_whitespace_verdicts_follow_tinyzero(answer, expected):
    completion = f"<answer>{answer}</answer>"
    assert ref.tinyzero_score((7, 1, 5), 34, completion) == expected
    assert countdown.score((7, 1, 5), 34, completion) == expected


@pytest.mark.parametrize("completion, expected", [
    ("<answer>7*5-1</answer>\n", 0.0),  # the last line is empty
    ("<answer>7*5-1</answer>\nno answer here", 0.0),
    ("<answer>7+5+1</answer>\n<answer>7*5-1</answer>", 1.0),
    ("<answer>7*5-1</answer>\n<answer>7+5+1</answer>", 0.1),
    ("<answer>7*5\n-1</answer>", 0.0),  # an answer never spans lines
    ("<answer><answer>7*5-1</answer>", 0.1),  # the match starts at the first opening: '<answer>7*5-1'
    ("<answer>7*5-1</answer>x</answer>", 1.0),  # a closing with no opening after the last match is ignored
])
def test_last_line_and_last_answer_reading(completion, expected):
    assert ref.tinyzero_score((7, 1, 5), 34, completion) == expected
    assert countdown.score((7, 1, 5), 34, completion) == expected


class _CountingText(str):
    """A str whose find/rfind add the characters they scan to `scanned` (CPython's searches are linear in the
    window they scan, for a fixed needle)."""

    scanned = 0

    def find(self, sub, start=0, end=None):
        found = str.find(self, sub, start)
        _CountingText.scanned += (found + len(sub) if found >= 0 else len(self)) - start
        return found

    def rfind(self, sub, start=0, end=None):
        found = str.rfind(self, sub, start)
        _CountingText.scanned += len(self) - max(found, start)
        return found


@pytest.mark.parametrize("unit", ["<answer>", "<answer>1", "<answer></answer>", "</answer>", "<answer>\n",
                                  "<answer>7*5-1</answer>", "<answer" + "x" * 7])
def test_answer_extraction_scans_each_character_a_bounded_number_of_times(unit):
    """Linear time whatever the input: the search windows do not overlap, so the characters scanned stay within
    twice the length (TinyZero's regex rescans the rest of the line from every unclosed opening: quadratic)."""
    for size in (60_000, 240_000):
        text = _CountingText((unit * (size // len(unit) + 1))[:size])
        _CountingText.scanned = 0
        countdown.extract_answer(text)
        assert _CountingText.scanned <= 2 * len(text) + 64
