"""Built-in rewards on their edge cases: whitespace, think tags, boxed answers, fractions, int answers."""

import pytest

from fsdptrain.rewards import exact_match, final_answer, math_reward, think_format, word_match


def one(fn, completion, **columns):
    [score] = fn(prompts=["p"], completions=[completion], completion_ids=[[0]], **{k: [v] for k, v in columns.items()})
    return score


@pytest.mark.parametrize("completion, expected", [
    ("  7 \n", "7"),
    ("<think>it is 6</think> 7", "7"),
    ("<think>a</think>x<think>b</think>  8 ", "8"),  # after the last </think>
    ("<think>never closed 7", ""),
    ("no tags at all", "no tags at all"),
    ("<think>x</think>", ""),
])
def test_final_answer(completion, expected):
    assert final_answer(completion) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("7", "7", 1.0),
    ("  7\n", " 7 ", 1.0),
    ("7", 7, 1.0),  # an int answer column
    ("<think>3 + 4</think>\n7", 7, 1.0),
    ("<think>3 + 4 = 7", 7, 0.0),  # unclosed think: no final answer
    ("7 .", "7", 0.0),
    ("1 7", "17", 0.0),  # inner spaces count
    ("Seven", "seven", 0.0),  # case counts
    ("7", None, None),  # no answer: not applicable
])
def test_exact_match(completion, answer, expected):
    assert one(exact_match, completion, answer=answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is \\boxed{7}", 7, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction vs decimal
    ("0.5", "1/2", 1.0),
    ("<think>maybe 8</think> so \\boxed{7}", "7", 1.0),
    ("<think>it is 7</think> \\boxed{8}", "7", 0.0),  # the thought does not count
    ("\\boxed{8}", 7, 0.0),
    ("no number here", 7, 0.0),
    ("", 7, 0.0),
    ("7", "not math at all", None),  # an answer math_verify cannot parse: not applicable
    ("7", None, None),
])
def test_math(completion, answer, expected):
    assert one(math_reward, completion, answer=answer) == expected


@pytest.mark.parametrize("completion, expected", [
    ("<think>a</think>b", 1.0),
    ("  <think>\nlong\nthought\n</think>\n answer \n", 1.0),
    ("<think></think>b", 1.0),  # an empty thought is allowed
    ("<think>a</think>", 0.0),  # no answer
    ("<think>a</think>   ", 0.0),
    ("b<think>a</think>c", 0.0),  # text before the tag
    ("<think>a<think>b</think>c</think>d", 0.0),  # nested
    ("<think>a</think>b</think>c", 0.0),  # a second close
    ("<think>a</think>b<think>c</think>d", 0.0),  # repeated
    ("a</think>b", 0.0),
    ("<think>a", 0.0),
    ("plain answer", 0.0),
])
def test_think_format(completion, expected):
    assert one(think_format, completion) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("7 7 7", "7 7 7", 1.0),
    ("7 1 7", "7 7 7", 2 / 3),
    ("7", "7 7 7", 1 / 3),  # missing words score 0
    ("7 7 7 7 7", "7 7 7", 1.0),  # words past the answer are ignored
    ("  3\n 2 ", "3 2", 1.0),
    ("", "3 2", 0.0),
    ("5", 5, 1.0),
])
def test_word_match(completion, answer, expected):
    assert one(word_match, completion, answer=answer) == expected


def test_word_match_refuses_an_empty_answer():
    with pytest.raises(ValueError, match="the answer ' ' has no words"):
        one(word_match, "7", answer=" ")
