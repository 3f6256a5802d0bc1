"""The checkpointer's state protocol (fsdptrain/run/checkpointer.py, docs/checkpointing.md): every part saves itself,
and a checkpoint of the older layout (counters written one by one into `extra`) loads into the same parts."""

from pathlib import Path

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.data.epoch_order import EpochOrder
from fsdptrain.train.drafter_setup import DrafterExtension
from fsdptrain.train.optim import GradNormWatch, NonFiniteGuard
from fsdptrain.run.checkpointer import STATE_LAYOUT, saved_states

# trainer_state.pt's `extra` as layout 1 wrote it (fsdptrain before the state protocol), with a drafter
LAYOUT_1 = {
    "step": 2, "data_position": 16,
    "nonfinite": {"policy": [3, 1], "critic": [2, 0]},
    "grad_norm_watch": [4, 0],
    "prompt_order": {"epoch": 1, "position": 5, "seed": 0, "num_rows": 9},
    "reward_model_moments": [{"count": 8.0, "mean": 0.5, "m2": 2.0}],
    "drafter_nonfinite": [1, 1],
    "draft_counts": torch.tensor([1.0, 2.0]),
}


def _guards_and_watches():
    return {"policy_guard": NonFiniteGuard(5), "critic_guard": NonFiniteGuard(5),
            "policy_watch": GradNormWatch(10.0, 1.0, "policy"), "critic_watch": GradNormWatch(10.0, 1.0, "critic")}


def test_a_layout_1_checkpoint_loads_into_the_parts():
    parts = _guards_and_watches()
    states = saved_states(LAYOUT_1, Path("ckpt"), {**parts, "drafter": DrafterExtension})
    for name, part in parts.items():
        part.load_state_dict(states[name])
    assert (parts["policy_guard"].num_skipped, parts["policy_guard"].num_in_a_row) == (3, 1)
    assert (parts["critic_guard"].num_skipped, parts["critic_guard"].num_in_a_row) == (2, 0)
    assert (parts["policy_watch"].in_a_row, parts["critic_watch"].in_a_row) == (4, 0)
    order = EpochOrder(9, seed=0)
    order.load_state_dict(states["source"]["prompt_order"])
    assert (order.epoch, order.position) == (1, 5)
    assert states["source"]["reward_model_moments"] == LAYOUT_1["reward_model_moments"]
    assert states["drafter"]["guard"] == {"num_skipped": 1, "num_in_a_row": 1}
    assert torch.equal(states["drafter"]["draft_counts"], torch.tensor([1.0, 2.0]))


def test_the_current_layout_round_trips_through_the_parts():
    parts = _guards_and_watches()
    parts["policy_guard"].num_skipped, parts["critic_watch"].in_a_row = 7, 2
    extra = {"state_layout": STATE_LAYOUT, "states": {name: p.state_dict() for name, p in parts.items()}}
    fresh = _guards_and_watches()
    for name, state in saved_states(extra, Path("ckpt"), fresh).items():
        fresh[name].load_state_dict(state)
    assert fresh["policy_guard"].num_skipped == 7 and fresh["critic_watch"].in_a_row == 2


def test_an_unknown_layout_is_refused_with_one_line():
    with pytest.raises(ConfigError) as err:
        saved_states({"state_layout": STATE_LAYOUT + 1, "states": {}}, Path("ckpt"), {})
    message = str(err.value)
    assert "\n" not in message and f"layout {STATE_LAYOUT + 1}" in message and "ckpt" in message
