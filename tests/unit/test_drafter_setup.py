"""The co-trained drafter's set-up: the vocabulary from all-reduced counts, the token counts, the size rules."""

from __future__ import annotations

import pytest
import torch

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.model.drafter import build_draft_vocab, draft_vocab_from_counts
from fsdptrain.train.drafter_setup import draft_vocab_size, local_token_counts

SEQS = [[5, 5, 2, 9], [2, 5, 7], [9, 9, 1]]  # counts: 5 x3, 9 x3, 2 x2, 1 x1, 7 x1


def test_vocab_from_counts_is_build_draft_vocab_of_the_sequences():
    counts = torch.zeros(12, dtype=torch.float64)
    for seq in SEQS:
        counts += torch.bincount(torch.tensor(seq), minlength=12).double()
    for size in (1, 2, 3, 5, 7, 12):  # ties (5/9, 1/7), and sizes past the seen ids (filled with the lowest unseen)
        want = build_draft_vocab(SEQS, vocab_size=12, draft_vocab_size=size)
        got = draft_vocab_from_counts(counts, draft_vocab_size=size)
        assert torch.equal(got.d2t, want.d2t) and torch.equal(got.t2d, want.t2d), size
    # by hand: the top 3 are 5 and 9 (3 each) then 2 (2); top 5 adds 1 and 7 (1 each); 7 adds the lowest unseen 0, 3
    assert draft_vocab_from_counts(counts, draft_vocab_size=3).draft_to_target.tolist() == [2, 5, 9]
    assert draft_vocab_from_counts(counts, draft_vocab_size=7).draft_to_target.tolist() == [0, 1, 2, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab_from_counts(counts, draft_vocab_size=13)


def test_local_token_counts_response_or_all():
    rollouts = [Rollout(prompt_ids=[1, 2], response_ids=[3, 3], reward=0.0, group=0),
                Rollout(prompt_ids=[2], response_ids=[], reward=0.0, group=0)]
    assert local_token_counts(rollouts, 5, on="response").tolist() == [0, 0, 0, 2, 0]
    assert local_token_counts(rollouts, 5, on="all").tolist() == [0, 1, 2, 2, 0]


def test_draft_vocab_size_default_and_bounds():
    cfg = compose_config(["drafter.enabled=true"])
    assert draft_vocab_size(cfg, 24) == 24
    assert draft_vocab_size(cfg, 50000) == 32000
    cfg = compose_config(["drafter.enabled=true", "drafter.draft_vocab_size=30"])
    with pytest.raises(ConfigError, match="drafter.draft_vocab_size=30 is larger than the policy's vocabulary of 24"):
        draft_vocab_size(cfg, 24)


@pytest.mark.parametrize("override, needle", [
    ("drafter.feature_layers=[1,2]", "must name 3 policy layers"),
    ("drafter.draft_vocab_size=0", "drafter.draft_vocab_size=0"),
    ("drafter.on=prompt", "drafter.on='prompt'"),
    ("drafter.export_dtype=int8", "drafter.export_dtype"),
    ("drafter.lr=0", "drafter.lr=0"),
    ("drafter.vocab_from_steps=5", "drafter.vocab_from_steps=5 must be at most trainer.steps=3"),
])
def test_bad_drafter_config_is_one_config_error(override, needle):
    with pytest.raises(ConfigError, match=None) as err:
        compose_config(["drafter.enabled=true", "trainer.steps=3", override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_default_drafter_lr_follows_a_faster_policy():
    from fsdptrain.train.drafter_setup import drafter_lr

    assert drafter_lr(compose_config(["drafter.enabled=true"])) == 3e-3  # the bundled default's trainer.lr
    assert drafter_lr(compose_config(["drafter.enabled=true", "trainer.lr=1e-6"])) == 1e-4  # EAGLE-3's rate
    assert drafter_lr(compose_config(["drafter.enabled=true", "drafter.lr=5e-4"])) == 5e-4
