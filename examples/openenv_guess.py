"""A number-guessing game written as an OpenEnv environment, trained by creditrl unchanged:

    creditrl train examples/openenv_guess.yaml                          # in process
    creditrl train examples/openenv_guess.yaml env.openenv=examples/openenv_guess.py:app  # served

The secret is a number from 1 to ``high`` drawn from the reset seed; each guess is answered
"higher" or "lower" until it is right (reward 1, done) or the turns run out. Everything is
local: ``GuessEnvironment`` runs in the trainer's process, and ``app`` (what OpenEnv's
``create_app`` makes of it, an environment's usual ``server/app.py``) is served by creditrl on
127.0.0.1. Needs ``pip install 'creditrl[openenv]'``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    """A guess, as the model wrote it."""

    guess: str = Field(..., description="the reply; its last number is the guess")


class GuessObservation(Observation):
    """What the game says."""

    prompt: str = Field(default="", description="the game's message to the player")


class GuessEnvironment(Environment):
    """Guess the secret number; "higher" or "lower" after each wrong guess."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance has its own game

    def __init__(self, high: int = 4) -> None:
        super().__init__()
        self.high = high
        self.secret = 1
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(
            prompt=f"I am thinking of a number from 1 to {self.high}. Guess it: reply with one "
            "number."
        )

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **_: Any
    ) -> GuessObservation:
        self._state.step_count += 1
        numbers = NUMBER.findall(action.guess)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            return GuessObservation(prompt="Right!", done=True, reward=1.0)
        hint = (
            "No number found."
            if guess is None
            else ("Higher." if guess < self.secret else "Lower.")
        )
        return GuessObservation(prompt=f"{hint} Guess again.", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8
)
