"""A trained part (fsdptrain/train/trained_part.py) is what both recipes train: `build_part` gives it the AdamW, the
schedule, the clip, the guard and the watch its config names; its update is the product's `update_on_minibatch`
with those, its watch sees the norm, its metrics and facts carry its prefix; it saves under the checkpoint names
runs wrote before the part existed (``policy``, ``policy_guard``, ...). One process, a tiny policy."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fsdptrain.config.compose import compose_config
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.metrics.typed import Metrics, Sum, finalize
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets, ValueLossSettings
from fsdptrain.train.setup import build_part
from fsdptrain.train.optim import NonFiniteGuard
from fsdptrain.train.step import MiniBatch, packed_policy_loss, packed_value_loss, update_on_minibatch
from fsdptrain.train.trained_part import checkpointed_parts

PROMPTS = [[1, 5, 9], [1, 7]]
RESPONSES = [[4, 4, 6, 2], [9, 2, 17]]
SETTINGS = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                              seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.01,
                              temperature=1.0, chunk_size=4)
CFG = compose_config(["trainer.lr=0.02", "trainer.adam_beta1=0.8", "trainer.weight_decay=0.1",
                      "trainer.warmup_steps=2", "trainer.grad_norm_warn_factor=2"])
CLIP = 1e-3
"""Far below the norm: the clip changes the step, and the watch counts it (norm > 2 x clip)."""


def tiny_policy() -> LlamaForCausalLM:
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                          tie_word_embeddings=False)).float()
    set_attention(policy, "sdpa_segments")
    return policy


def batch() -> MiniBatch:
    gen = torch.Generator().manual_seed(3)
    targets = [SeqTargets(old_logprobs=-3.0 + 0.3 * torch.randn(len(r), generator=gen),
                          advantages=torch.randn(len(r), generator=gen),
                          response_mask=torch.tensor([True] * (len(r) - 1) + [False])) for r in RESPONSES]
    return MiniBatch(PROMPTS, RESPONSES, targets)


def policy_part(model):
    return build_part(CFG, model, name="policy", prefix="actor/", lr=CFG.trainer.lr, grad_clip=CLIP,
                      loss_fn=packed_policy_loss, settings=SETTINGS, num_steps=10)


LAYOUT = dict(dp_size=1, loss_scale_factor=None, token_budget=16, device=torch.device("cpu"))


def test_a_part_steps_as_the_update_it_wraps_with_the_settings_its_config_names():
    part, model = policy_part(tiny_policy()), tiny_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02 * 0.5, betas=(0.8, 0.999), weight_decay=0.1,
                                  fused=True)  # warmup 1/2; the fused kernel, as build_optimizer
    assert part.lr == 0.02 * 0.5

    for _ in range(2):  # AdamW's first step is lr x sign(g) whatever its betas: the second tells them apart
        metrics, outcome = part.update(batch(), **LAYOUT)
        want_metrics, want = update_on_minibatch(model, optimizer, batch(), loss_fn=packed_policy_loss,
                                                 settings=SETTINGS, grad_clip=CLIP, guard=NonFiniteGuard(3), **LAYOUT)
        assert finalize(metrics) == finalize(want_metrics) and outcome.grad_norm == want.grad_norm > 2 * CLIP

    for (name, got), (_, expected) in zip(part.model.named_parameters(), model.named_parameters()):
        assert torch.equal(got, expected), name
    assert part.watch.in_a_row == 2 and part.guard.num_skipped == 0
    part.scheduler.step()
    assert part.lr == 0.02


def test_a_part_names_its_metrics_and_facts():
    part = policy_part(tiny_policy())
    metrics, outcome = part.update(batch(), **LAYOUT)
    named = part.named(metrics.merge(Metrics({"drafter/loss": Sum(1.0)})))
    assert "actor/pg_loss" in named and "drafter/loss" in named and "pg_loss" not in named
    facts = finalize(part.facts(outcome))
    assert facts == {"actor/grad_norm": outcome.grad_norm, "loss/global_num_tokens": 3 + 2,
                     "loss/global_num_seqs": 2}


def test_parts_save_under_the_names_checkpoints_have():
    policy = policy_part(tiny_policy())
    critic = build_part(CFG, tiny_policy(), name="critic", prefix="critic/", lr=0.01, grad_clip=1.0,
                        loss_fn=packed_value_loss, settings=ValueLossSettings(agg_mode="token-mean",
                                                                              cliprange_value=0.2), num_steps=10)
    source = NonFiniteGuard(1)
    saved = checkpointed_parts([policy, critic], states={"source": source})
    assert saved.models == {"policy": policy.model, "critic": critic.model}
    assert saved.optimizers == {"policy": policy.optimizer, "critic": critic.optimizer}
    assert saved.schedulers == {"policy": policy.scheduler, "critic": critic.scheduler}
    assert saved.states == {"policy_guard": policy.guard, "policy_watch": policy.watch,
                            "critic_guard": critic.guard, "critic_watch": critic.watch, "source": source}
    assert critic.watch.name == "critic" and critic.watch.clip == 1.0 and critic.optimizer.param_groups[0]["lr"] == 0.005
