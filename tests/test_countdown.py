"""Countdown: generator, TinyZero-equivalent scoring without eval, fuzzing, tokenizer."""

import itertools
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


def test_the_held_out_split_is_never_drawn_for_training_and_is_the_whole_evaluation():
    """A hashed split of (sorted numbers, target): every evaluation problem is held out, no training draw of
    any seed or step is (a reordering of) one, the split is the same for every seed, and it holds about the
    requested fraction of the problem space."""
    from jaxalign.rl.task import CountdownTask

    task = CountdownTask(count=(2, 2), high=20, eval_size=10_000, held_out=0.2)
    evals = task.eval_items(seed=0)
    assert evals == task.eval_items(seed=7)
    key = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    held = {key(p) for p in evals}
    assert len(held) == len(evals)  # distinct problems
    space = {(n, t) for n in itertools.combinations_with_replacement(range(1, 21), 2)
             for t in countdown.reachable_targets(n, 99)}
    assert held == {k for k in space if countdown.is_held_out(k[0], k[1], 0.2)}  # the whole split
    assert 0.15 < len(held) / len(space) < 0.25
    for p in evals:
        assert countdown.score(p.numbers, p.target, f"<answer>{p.solution}</answer>") == 1.0
    drawn = {key(p) for seed in range(3) for step in range(60) for p in task.train_items(step, 16, seed)}
    assert drawn and not drawn & held
    assert len(drawn | held) > 0.9 * len(space)  # training covers the rest of the space
    # a smaller eval_size takes the split's first problems; held_out = 0 keeps seed-drawn evaluation
    assert CountdownTask(count=(2, 2), high=20, eval_size=5, held_out=0.2).eval_items(0) == evals[:5]
    old = CountdownTask(count=(2, 2), high=20, eval_size=50)
    assert old.eval_items(0) != old.eval_items(1)
    with pytest.raises(ValueError, match="held_out"):
        CountdownTask(held_out=1.0)


def test_the_default_experiments_held_out_problems_never_occur_among_its_training_problems():
    """`jaxalign experiment countdown` and `jaxalign demo` by default evaluate on a held-out split: none of its
    problems is drawn for RL training (any seed, any step) or for the SFT warm start."""
    from jaxalign.rl.experiment import ExperimentConfig
    from jaxalign.rl.sft import sft_problems

    exp = ExperimentConfig()
    task = exp.task()
    assert exp.held_out > 0 and exp.sft.held_out == exp.held_out
    key = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    held = {key(p) for p in task.eval_items(seed=0)}
    assert held and held == {key(p) for p in task.eval_items(seed=3)}
    drawn = {key(p) for seed in range(4) for step in range(exp.steps) for p in task.train_items(
        step, exp.prompts_per_step, seed)}
    assert drawn and not drawn & held
    assert not {key(p) for p in sft_problems(exp.sft)} & held


def test_a_held_out_split_of_a_large_space_is_sampled_and_still_disjoint_from_training():
    problems = countdown.held_out_problems(0.1, count=(3, 3), high=60, limit=40)
    assert len({(tuple(sorted(p.numbers)), p.target) for p in problems}) == 40
    assert all(countdown.is_held_out(p.numbers, p.target, 0.1) for p in problems)
    train = countdown.generate_problems(300, seed=1, count=(3, 3), high=60, held_out=0.1)
    assert not any(countdown.is_held_out(p.numbers, p.target, 0.1) for p in train)
    with pytest.raises(ValueError, match="limit"):
        countdown.held_out_problems(0.1, count=(3, 3), high=60)


def test_reachable_targets_are_every_expressions_values():
    """The memoised split-based enumeration gives the targets of every expression tree (`_expressions`, the
    brute force `solve` walks), on random multisets of 2-4 numbers with zeros and repeats."""
    import random
    from fractions import Fraction

    from jaxalign.rl import countdown

    rng = random.Random(0)
    for _ in range(30):
        numbers = tuple(rng.randint(0, 15) for _ in range(rng.randint(2, 4)))
        brute = {int(v) for v, _ in countdown._expressions([(Fraction(x), "") for x in numbers])
                 if v.denominator == 1 and 1 <= v <= 150}
        assert countdown.reachable_targets(numbers, 150) == sorted(brute), numbers


def _left_to_right(numbers, ops):
    """A chain's value by plain integer arithmetic, or None where an intermediate value is not a whole number."""
    value = numbers[0]
    for op, n in zip(ops, numbers[1:]):
        if op == "/" and (n == 0 or value % n):
            return None
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n if op == "/" else None}[op]
    return value


def test_chain_targets_are_exactly_the_left_to_right_values_and_their_solutions_score_one():
    """`chain_solutions` against integer arithmetic over every operator sequence (zeros, ones and repeats
    included); each solution is a chain over the numbers in the order given (its worked steps name them in
    that order) and scores 1.0."""
    import random

    rng = random.Random(1)
    for _ in range(60):
        numbers = tuple(rng.randint(0, 9) for _ in range(rng.randint(2, 4)))
        values = {_left_to_right(numbers, ops) for ops in itertools.product("+-*/", repeat=len(numbers) - 1)}
        solutions = countdown.chain_solutions(numbers)
        assert set(solutions) == {v for v in values if v is not None and v >= 1}, numbers
        for target, expression in solutions.items():
            assert countdown.score(numbers, target, f"<answer>{expression}</answer>") == 1.0
            steps = countdown.worked_steps(expression).split()
            assert [int(s.split("=")[0].split("+")[0].split("-")[0].split("*")[0].split("/")[0])
                    for s in steps[:1]] == [numbers[0]]
            assert len(steps) == len(numbers) - 1


def test_chain_problems_are_held_out_as_any_problems_are():
    """`targets="chain"`: training draws chain targets of the numbers as shown and never a held-out problem; the
    held-out split's problems are shown in an order whose chain reaches the target; an unknown kind is refused
    naming the allowed ones."""
    from jaxalign.rl.task import CountdownTask

    task = CountdownTask(count=(3, 4), eval_size=300, held_out=0.2, targets="chain", answer_format="steps")
    key = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    evals = task.eval_items(seed=0)
    assert len({key(p) for p in evals}) == 300 and evals == task.eval_items(seed=5)
    for p in evals:
        assert countdown.is_held_out(p.numbers, p.target, 0.2)
        assert countdown.chain_solutions(p.numbers)[p.target] == p.solution
    drawn = [p for step in range(40) for p in task.train_items(step, 16, seed=0)]
    assert not {key(p) for p in drawn} & {key(p) for p in evals}
    assert all(countdown.chain_solutions(p.numbers)[p.target] == p.solution for p in drawn)
    assert {len(p.numbers) for p in drawn} == {3, 4}
    assert task.describe()["targets"] == "chain" and "targets" not in CountdownTask().describe()
    for bad in ("chains", "", "ANY"):
        with pytest.raises(ValueError, match="allowed: any, chain"):
            CountdownTask(targets=bad)
        with pytest.raises(ValueError, match="allowed: any, chain"):
            countdown.generate_problems(1, seed=0, targets=bad)
