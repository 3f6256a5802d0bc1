"""The seeded order in which a recipe visits its training rows, epoch after epoch: the RL prompts
(fsdptrain/rollout/prompt_source.py) and the SFT demonstrations (fsdptrain/train/sft.py) alike."""

from __future__ import annotations

import random

from fsdptrain.config import ConfigError


class EpochOrder:
    """The training rows visited in a seeded shuffled order, a new permutation per epoch, across step boundaries.

    Epoch ``e`` visits ``permutation(e)`` of ``range(num_rows)``, derived from ``(seed, e)`` only. The state is
    ``(epoch, position)``: two integers, saved with :meth:`state_dict` and restored with :meth:`load_state_dict`, so
    a resumed run takes exactly the rows an uninterrupted one would. The order is global (the same on every rank and
    for any world size); which rank owns which of a step's rows is the caller's business.
    """

    def __init__(self, num_rows: int, *, seed: int):
        if num_rows < 1:
            raise ConfigError(f"no training prompts left (num_rows={num_rows})")
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.position = 0, 0
        self._perm = self.permutation(0)

    def permutation(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s visiting order: a pure function of (seed, epoch, num_rows)."""
        order = list(range(self.num_rows))
        random.Random(f"epoch:{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        """The next ``count`` row positions (into the training rows), crossing into the next epoch(s) as needed."""
        out = []
        while len(out) < count:
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self.permutation(self.epoch)
            step = min(count - len(out), self.num_rows - self.position)
            out.extend(self._perm[self.position:self.position + step])
            self.position += step
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved position; a different seed or number of rows means another dataset: ConfigError."""
        if state["seed"] != self.seed or state["num_rows"] != self.num_rows:
            raise ConfigError(f"the checkpoint's prompt order was for {state['num_rows']} rows with seed "
                              f"{state['seed']}, this run has {self.num_rows} rows with seed {self.seed}: the "
                              f"dataset or data.seed changed since the checkpoint")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm = self.permutation(self.epoch)
