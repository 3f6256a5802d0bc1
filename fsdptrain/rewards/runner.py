"""Score a batch of completions with the configured reward functions: raw scores, the weighted total, and counts.

The total of a sample is ``sum_f w_f * r_f`` over the functions that returned a number for it; None (not applicable)
is left out, as TRL's ``nansum`` over functions does. A sample to which no function applied gets total 0.0 (TRL's
``nansum`` gives 0 too, after a warning) and is counted in ``num_no_reward`` so it shows in the metrics.

Calls: with ``num_workers=0`` each function is called once, in this process, on the whole batch (as TRL does). With
``num_workers > 0`` each function is called once per prompt group, in worker processes
(:mod:`fsdptrain.rewards.pool`). Either way every call goes through :func:`fsdptrain.rewards.pool.call_user_code`,
and a call running past ``timeout_s`` scores ``timeout_score`` for each of its samples (counted per function): a
worker's call is killed with the worker, a call in this process is abandoned on its thread. A function that depends
on the whole batch rather than on one group should run with ``num_workers=0``.

Values: a number (``int``, ``float``, anything ``numbers.Real``; ``bool`` counts as 1.0/0.0, as TRL's float tensor
would make it) or None. Anything else, a non-finite number, the wrong number of values, an exception, or an attempt
to end the process (``sys.exit``, ``os._exit`` with any status, a ``BaseException``; a worker that dies) is a
:class:`RewardError` naming the function, the sample's row and the cause, carrying the user's traceback when it
raised.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence

from fsdptrain.config import ConfigError
from fsdptrain.rewards.loading import RewardFunction
from fsdptrain.rewards.pool import START_TIMEOUT_S, Call, Outcome, WorkerPool, WorkerStartError, run_call


class UserCodeError(RuntimeError):
    """The user's code (``what``: "reward function 'f'", "tool 'add'", ...) failed at run time in a way that stops
    the run (exit 2, fsdptrain/worker.py). ``str()`` is one line (what, row when one is known, cause);
    ``user_traceback`` is the traceback of the user's own code when it raised ("" otherwise), for display above that
    line."""

    def __init__(self, what: str, row: Optional[int], cause: str, user_traceback: str = ""):
        where = "" if row is None else f" on row {row} (0-based)"
        super().__init__(f"{what}{where}: {cause}")
        self.row, self.cause, self.user_traceback = row, cause, user_traceback


class RewardError(UserCodeError):
    """A reward function failed at run time (see :class:`UserCodeError`)."""

    def __init__(self, function: str, row: Optional[int], cause: str, user_traceback: str = ""):
        super().__init__(f"reward function {function!r}", row, cause, user_traceback)
        self.function = function


class RewardFailedOnAnotherRank(RuntimeError):
    """This rank's rewards were fine but a reward function failed on another rank, which reports the
    :class:`RewardError`; every rank stops (the trainer agrees on the failure so that no rank waits forever)."""


@dataclass(frozen=True)
class RewardBatch:
    """The samples to score, one entry per sample in every list: ``rows`` are the prompts' 0-based dataset rows and
    ``groups`` the prompt groups' global indices; ``columns`` maps each other dataset column to its per-sample values."""

    prompts: list[str]
    completions: list[str]
    completion_ids: list[list[int]]
    rows: list[int]
    groups: list[int]
    columns: dict[str, list] = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.completions)
        sizes = [len(self.prompts), len(self.completion_ids), len(self.rows), len(self.groups),
                 *(len(v) for v in self.columns.values())]
        assert all(s == n for s in sizes), f"RewardBatch lists differ in length: {n} completions, {sizes}"

    def __len__(self) -> int:
        return len(self.completions)

    def select(self, indices: Sequence[int]) -> dict:
        """The reward function's keyword arguments for the samples at ``indices``."""
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        return {"prompts": pick(self.prompts), "completions": pick(self.completions),
                "completion_ids": pick(self.completion_ids), **{k: pick(v) for k, v in self.columns.items()}}


@dataclass(frozen=True)
class RewardScores:
    """``raw[name]``: each function's score per sample (None where not applicable; ``timeout_score`` where its call
    timed out); ``total``: the weighted sum per sample; ``num_timed_out[name]``: samples scored by timeout;
    ``num_no_reward``: samples to which no function applied (total 0.0)."""

    raw: dict[str, list[Optional[float]]]
    total: list[float]
    num_timed_out: dict[str, int]
    num_no_reward: int


class RewardRunner:
    """Runs the configured functions on batches; close it (or use ``with``) so its worker processes end."""

    def __init__(self, functions: Sequence[RewardFunction], *, num_workers: int = 0,
                 timeout_s: Optional[float] = None, timeout_score: float = 0.0,
                 start_timeout_s: float = START_TIMEOUT_S):
        if num_workers < 0:
            raise ConfigError(f"reward.num_workers={num_workers} must be >= 0")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"reward.timeout_s={timeout_s} must be > 0 (or null for no timeout)")
        if not math.isfinite(timeout_score):
            raise ConfigError(f"reward.timeout_score={timeout_score} must be a finite number")
        self.functions = list(functions)
        self.timeout_s, self.timeout_score = timeout_s, float(timeout_score)
        self.call_seconds: dict[str, list[float]] = {f.name: [] for f in self.functions}
        """How long each function's calls of the last :meth:`score` ran (the function itself, not the transport)."""
        try:  # the workers import the functions now, outside any call's deadline
            self.pool = (WorkerPool([f.spec for f in self.functions], num_workers, start_timeout_s=start_timeout_s)
                         if num_workers > 0 else None)
        except WorkerStartError as err:
            raise RewardError(self.functions[err.function].label, None, str(err)) from None

    def score(self, batch: RewardBatch) -> RewardScores:
        """Score every sample with every function; raises :class:`RewardError` on a failing function."""
        chunks = _group_chunks(batch.groups) if self.pool else [list(range(len(batch)))]
        calls = [(k, chunk) for k in range(len(self.functions)) for chunk in chunks]
        if self.pool:
            try:
                outcomes = self.pool.map([Call(k, batch.select(chunk)) for k, chunk in calls],
                                         timeout_s=self.timeout_s)
            except WorkerStartError as err:  # a replacement worker could not import
                raise RewardError(self.functions[err.function].label, None, str(err)) from None
        else:
            outcomes = [run_call(self.functions[k].fn, batch.select(chunk), timeout_s=self.timeout_s)
                        for k, chunk in calls]
        raw = {f.name: [None] * len(batch) for f in self.functions}
        timed_out = {f.name: 0 for f in self.functions}
        self.call_seconds = {f.name: [] for f in self.functions}
        for (k, chunk), outcome in zip(calls, outcomes):
            name = self.functions[k].name
            if outcome.status != "timeout":
                self.call_seconds[name].append(outcome.seconds)
            if outcome.status == "timeout":
                timed_out[name] += len(chunk)
                values = [self.timeout_score] * len(chunk)
            else:
                values = _check_outcome(outcome, self.functions[k].label, [batch.rows[i] for i in chunk])
            for i, value in zip(chunk, values):
                raw[name][i] = value
        return _combine(raw, self.functions, timed_out)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _group_chunks(groups: Sequence[int]) -> list[list[int]]:
    chunks: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        chunks.setdefault(g, []).append(i)
    return list(chunks.values())


def _check_outcome(outcome: Outcome, name: str, rows: list[int]) -> list[Optional[float]]:
    covered = f"the call covered {len(rows)} samples"
    if outcome.status == "raised":
        raise RewardError(name, rows[0], f"raised {outcome.message} ({covered})", outcome.traceback)
    if outcome.status == "ended":
        raise RewardError(name, rows[0], f"{outcome.message} (a reward function returns its values; it must not "
                                         f"exit) ({covered})")
    if outcome.status == "failed":
        raise RewardError(name, rows[0], f"{outcome.message} ({covered})")
    values = outcome.values
    if len(values) != len(rows):
        raise RewardError(name, rows[0], f"returned {len(values)} values for {len(rows)} samples")
    return [_check_value(v, name, row) for v, row in zip(values, rows)]


def _check_value(value, name: str, row: int) -> Optional[float]:
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        raise RewardError(name, row, f"returned {type(value).__name__} {value!r:.60}, not a number or None")
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) beyond 1.8e308
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        raise RewardError(name, row, f"returned {type(value).__name__}{size}, too large for a float") from None
    except (TypeError, ValueError) as err:  # a Real whose float() fails
        raise RewardError(name, row, f"returned {type(value).__name__}, which float() refuses "
                                     f"({type(err).__name__}: {err})") from None
    if not math.isfinite(number):
        raise RewardError(name, row, f"returned {number}, not a finite number")
    return number


def _combine(raw: dict[str, list[Optional[float]]], functions: Sequence[RewardFunction],
             timed_out: dict[str, int]) -> RewardScores:
    num = len(next(iter(raw.values())))
    total, num_no_reward = [], 0
    for i in range(num):
        applied = [(f.weight, raw[f.name][i]) for f in functions if raw[f.name][i] is not None]
        num_no_reward += not applied
        total.append(sum(w * v for w, v in applied) if applied else 0.0)
    return RewardScores(raw=raw, total=total, num_timed_out=timed_out, num_no_reward=num_no_reward)
