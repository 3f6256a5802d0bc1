"""The taskset of arith.py as the agent that ``rollout.agent=examples/verifiers/agent.py:run`` names."""

import verifiers.v1 as vf
from arith import SumTaskset

from fsdptrain.rollout.verifiers_agent import verifiers_agent

run = verifiers_agent(SumTaskset(vf.TasksetConfig()))
