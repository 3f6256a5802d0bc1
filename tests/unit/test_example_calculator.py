"""examples/calculator: the tool evaluates arithmetic safely (no names, calls or attributes reach Python), the reward
is an exact match on the final assistant turn."""

from __future__ import annotations

import pytest

from fsdptrain.registry.user_functions import load_callable

calculate = load_callable("examples/calculator/calculator.py:calculate", what="test")
exact_answer = load_callable("examples/calculator/reward.py:exact_answer", what="test")


def test_calculate_evaluates_arithmetic():
    assert calculate("47*83") == "3901"
    assert calculate(" (2 + 3) * -4 ") == "-20"
    assert calculate("7/2") == "3.5" and calculate("8/2") == "4" and calculate("2**10") == "1024"


@pytest.mark.parametrize("expression", ["__import__('os')", "x", "(1).real", "[1]", "2**1000", "1 +", "'a'*3"])
def test_calculate_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_exact_answer_reads_the_last_assistant_turn():
    call = {"role": "assistant", "content": "...", "tool_calls": [{"type": "function", "function": {}}]}
    completions = [[call, {"role": "tool", "content": "3901"}, {"role": "assistant", "content": "3901"}],
                   [call, {"role": "tool", "content": "3901"}],
                   "3901", "3900"]
    assert exact_answer([""] * 4, completions, [[]] * 4, answer=["3901"] * 4) == [1.0, 0.0, 1.0, 0.0]
