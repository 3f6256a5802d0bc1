"""Every sampling seed of a run, in one place, and what each depends on.

A seed is a pure function of where a sample sits in the run; none reads torch's global RNG. Which one a draw uses
depends on the engine (``rollout.engine``) and the mode (training, greedy or sampled evaluation):

====================  ==================================================  =========================================
seed                  depends on                                          used by
====================  ==================================================  =========================================
``row_seed``          trainer.seed, step, group (global index), sample,   ``continuous``: each training sample's
                      round, turn -- never the rank                       turn (a generator of its own)
``sampling_seed``     trainer.seed, step, rank                            ``generate``: through ``batch_seed``
``batch_seed``        ``sampling_seed``, round                            ``generate``: a rank's single-turn
                                                                          training batch (one generator)
``group_seed``        trainer.seed, step, group, round, turn -- never     ``generate``: one multi-turn group's
                      the rank                                            training turn (one generator)
``eval_sample_seed``  trainer.seed, step, prompt, sample -- never the     both engines: a sampled-evaluation
                      rank                                                sample (a generator of its own)
``eval_turn_seed``    the sample's eval seed, turn                        both engines: its later turns
====================  ==================================================  =========================================

Greedy decoding (the greedy evaluation) uses no seed. The row-seeded ones (``row_seed``, the eval seeds) make a
sample's tokens independent of the rank, the world size and the other rows of its batch; the batch seeds
(``sampling_seed``, ``group_seed``) are ``generate``'s, which draws a whole batch from one generator.
"""

from __future__ import annotations

import random


def row_seed(seed: int, step: int, group: int, sample: int, round_index: int, turn: int) -> int:
    """The training seed of one sample's turn under the continuous engine: where it is in the run, never the rank."""
    return random.Random(f"row:{seed}:{step}:{group}:{sample}:{round_index}:{turn}").getrandbits(62)


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """A rank's sampling seed for a step: reproducible across runs and resumes, different across ranks."""
    return (seed * 1_000_003 + step * 1_009 + rank) % (2**31)


def batch_seed(seed: int, step: int, rank: int, round_index: int) -> int:
    """The generator seed of a rank's single-turn training batch under ``generate``: :func:`sampling_seed`, offset
    per round of dynamic sampling."""
    return (sampling_seed(seed, step, rank) + 104_729 * round_index) % (2**31)


def group_seed(seed: int, step: int, group: int, round_index: int, turn: int) -> int:
    """The sampling seed of one group's turn: a function of where it is in the run, never of the rank."""
    return random.Random(f"turns:{seed}:{step}:{group}:{round_index}:{turn}").getrandbits(31)


def eval_sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of evaluation sample ``sample`` of evaluation prompt ``prompt`` after ``step`` steps: a function of
    these four only (never of the rank or the world size), so the samples are the same at any world size."""
    return ((((seed * 1_000_003 + step) * 1_000_033 + prompt) * 1_009 + sample) * 7_919 + 1) % (2**62)


def eval_turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of one turn of a sampled-evaluation sample: turn 0 uses the sample's own seed (``eval_sample_seed``),
    later turns one drawn from it and the turn, so a sample's turns never depend on the rank or the batch."""
    return sample_seed if turn == 0 else random.Random(f"eval-turn:{sample_seed}:{turn}").getrandbits(62)
