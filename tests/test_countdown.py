"""Countdown: generator, TinyZero-equivalent scoring without eval, fuzzing, tokenizer."""

from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from jaxalign.rl import countdown, tokenizer


@pytest.mark.parametrize("completion, expected", [
    ("no tags at all", 0.0),
    ("<answer>(7*5)-1</answer>", 1.0),
    ("<answer> 7*5 - 1 </answer>", 1.0),
    ("<answer>7*5-1</answer> then <answer>7+5+1</answer>", 0.1),  # the last answer counts
    ("<answer>7+5+1</answer> then <answer>(7*5)-1</answer>", 1.0),
    ("<answer>7*5</answer>", 0.1),  # a number missing
    ("<answer>7*5-1-1</answer>", 0.1),  # a number used twice
    ("<answer>7*5-1x</answer>", 0.1),  # a bad character
    ("<answer>7*5-1 = 34</answer>", 0.1),  # '=' is not allowed inside the answer
    ("<answer>7+5+1</answer>", 0.1),  # right numbers, wrong value
    ("<answer>(7*5-1</answer>", 0.1),  # unbalanced
    ("<answer>7/(5-5)*1</answer>", 0.1),  # division by zero, and 5 twice
    ("<answer></answer>", 0.1),
    ("<answer>34</answer>", 0.1),
    ("<answer>7.0*5.0-1.0</answer>", 0.1),  # TinyZero reads the digit runs 7 0 5 0 1 0: not the numbers
    ("<answer>(7*5-1).</answer>", 0.1),  # a stray '.': a syntax error for TinyZero's eval
    ("<answer>7*5-1</answer>\n", 0.0),  # TinyZero reads only the last line
])
def test_tinyzero_verdicts(completion, expected):
    assert countdown.score((7, 1, 5), 34, completion) == expected


def test_division_is_exact():
    assert countdown.score((1, 3, 3), 1, "<answer>(1/3)*3</answer>") == 1.0
    assert countdown.score((2, 3, 7), 1, "<answer>(2/3)+(7/21)*0</answer>") == 0.1


def test_format_score_is_configurable():
    assert countdown.score((7, 1, 5), 34, "<answer>7+1+5</answer>", format_score=0.0) == 0.0


def test_generated_problems_are_solvable_and_deterministic():
    problems = countdown.generate_problems(50, seed=3, count=(3, 4))
    assert problems == countdown.generate_problems(50, seed=3, count=(3, 4))
    assert problems != countdown.generate_problems(50, seed=4, count=(3, 4))
    for p in problems:
        assert 3 <= len(p.numbers) <= 4 and 1 <= p.target <= 99
        assert countdown.score(p.numbers, p.target, f"<answer>{p.solution}</answer>") == 1.0
        assert countdown.solve(p.numbers, p.target) is not None
    with pytest.raises(ValueError, match="count"):
        countdown.generate_problems(1, 0, count=(1, 5))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/(). <>answer/x\n\r\t\x0b\xa0\u0663", max_size=300))
def test_score_never_raises(text):
    assert countdown.score((3, 4, 5), 12, text) in (0.0, 0.1, 1.0)


@pytest.mark.parametrize("answer", ["9" * 5000, "(" * 1000 + "1" + ")" * 1000, "-" * 3000 + "1",
                                    "(" * 100 + "3*4+5-5" + ")" * 100, "1/0",
                                    "99999999999999999999*99999999999999999999"])
def test_hostile_answers_are_refused_by_the_guards(answer):
    """Guards bound the parser's work (the time bound on any input: tests/test_countdown_parity.py)."""
    assert countdown.score((3, 4, 5, 5), 12, f"<answer>{answer}</answer>") == 0.1


def test_tokenizer_round_trip_and_vocabulary():
    text = "7,1,5=34:<answer>(7*5)-1</answer>"
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS and max(ids) < tokenizer.VOCAB_SIZE
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [5, 6]) == text  # decoding stops at <eos>
    with pytest.raises(ValueError, match="not in the Countdown vocabulary"):
        tokenizer.encode("7 % 5")
    assert tokenizer.VOCAB_SIZE == 31


def test_parser_uses_exact_rationals():
    parser = countdown._Parser("1/3+1/3+1/3")
    assert parser.parse() == Fraction(1)
