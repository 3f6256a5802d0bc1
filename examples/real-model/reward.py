"""The example's reward: 1.0 when the last number in the completion is the answer, else 0.0.

Named in the run as ``'reward.functions=[examples/real-model/reward.py:last_number]'``. The signature is every reward
function's (TRL's): ``fn(prompts, completions, completion_ids, **columns)``, one score per completion; ``answer`` is
the prompt file's column. "The answer is 68." and "23 + 45 = 68" score 1; "23 + 45 equals" (cut off by
``rollout.max_new_tokens``) scores 0: its last number is 45.
"""

import re

NUMBER = re.compile(r"-?\d+")


def last_number(prompts, completions, completion_ids, answer, **columns):
    out = []
    for completion, gold in zip(completions, answer):
        numbers = NUMBER.findall(completion.replace(",", ""))
        out.append(float(bool(numbers) and int(numbers[-1]) == int(gold)))
    return out
