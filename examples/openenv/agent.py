"""The guessing game of guess.py as the agent that ``rollout.agent=examples/openenv/agent.py:run`` names."""

from guess import GuessAction, GuessEnvironment

from fsdptrain.rollout.openenv_agent import openenv_agent

run = openenv_agent(GuessEnvironment, action=GuessAction)
