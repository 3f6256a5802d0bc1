"""A guessing game as an OpenEnv environment (the ``openenv-core`` package): the secret is a number from 1 to 8 drawn
from the reset's seed; each step's observation says ``higher``, ``lower`` or ``correct``; reward 1 for the right
guess, and the episode ends there or after three guesses."""

from __future__ import annotations

import random
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TRIES = 3


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(..., description="your guess, from 1 to 8")


class GuessObservation(Observation):
    hint: str = Field(default="", description="what the last guess was: higher, lower or correct")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.secret = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = random.Random(seed).randint(1, 8)
        return GuessObservation(hint=f"The secret is a number from 1 to 8; you have {TRIES} guesses.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.secret:
            return GuessObservation(hint="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(hint=hint, done=self._state.step_count >= TRIES, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
