"""Sums of two digits as a verifiers taskset (the ``verifiers`` package, ``verifiers.v1``): 25 tasks, ``What is
a+b?`` for a and b from 0 to 4, scored by the task's rewards: ``correct`` (the reply is the sum) and ``short``
(weight 0.1: the reply is at most 4 characters, a number and no prose), and the metric ``length``."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with the number only."


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 4)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self) -> Iterable[SumTask]:
        for a in range(5):
            for b in range(5):
                yield SumTask(SumData(prompt=f"What is {a}+{b}?", system_prompt=SYSTEM_PROMPT, answer=str(a + b)))
