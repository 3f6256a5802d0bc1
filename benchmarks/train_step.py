"""A full PPO train step, packed (fsdptrain's own path) vs padded (TRL-style), on a skewed length mix. Not a test.

    PYTHONPATH=. python benchmarks/train_step.py [--repeats 2] [--json]

One step = experience + update, policy and value, the same passes on both sides:
- experience: the policy's log-probs of the responses and the critic's values, forwards under no_grad;
- update: one mini-batch, one epoch: policy forward + backward of the PPO-clip loss on the log-probs, clip to norm 1,
  AdamW step; critic forward + backward of the clipped value loss, clip, AdamW step.

packed (what the trainer runs, minus FSDP2's wrapping): the experience through `policy_logprobs` / `critic_values`
(fsdptrain/train/experience.py), the update through `update_on_minibatch` with `packed_policy_loss` /
`packed_value_loss` (fsdptrain/train/step.py, fsdptrain/rl/fused_loss.py): the sequences planned into rows under
`trainer.token_budget` (2048), each row one forward with position_ids on the varlen backend (`sdpa_segments` on the
CPU), the output head applied chunk by chunk by `chunked_logprobs_entropy` (the schema's `loss.logprob_chunk_size`),
which also gives the entropy the trainer logs, the losses once per row.

padded (TRL-style): one right-padded batch [B, L_max] with an attention mask through the HF model's standard sdpa
attention; the full [B, L, V] logits -> `log_softmax` -> `gather` (TRL's naive path), the entropy from the same
log-softmax under no_grad (TRL's PPO trainer logs it), masked means over the response tokens.

Both sides start from the same weights (their experience log-probs are compared before the first optimizer step),
take the same per-token advantages and returns (fixed random numbers: the advantage estimator costs microseconds and
is left out of both), one torch thread. The models are plain (not `fully_shard`ed) on both sides. Each side runs one
warm-up step, then --repeats timed steps, interleaved; the medians of the process's CPU time (the work, whatever else
the shared machine runs) and of the wall time are reported.

Lengths: 16 draws of round(exp(N(log 110, 1.0))) clipped to [8, 512] (median 110, sigma 1.0: E = 110 e^0.5 = 181
before the clip), seed 13: among seeds 0-29 the draw whose mean is nearest 180 while reaching the 512 clip (mean
183, lengths 18 ... 512, 512). A quarter of each sequence is prompt. The padding ceiling is 16 * L_max / sum(lengths):
the speed-up packing would give if the cost were linear in tokens; the padded side's quadratic attention over L_max
and its [B, L, V] logits passes are why the measured ratio can exceed it.

Suffixes: `_BL` [B, L_max] padded, `_R` one sequence's response tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time

import torch
from transformers import Qwen2Config
from transformers.utils import logging as hf_logging

from fsdptrain.config.schema import LossConfig, TrainerConfig
from fsdptrain.data.packing import pad_sequences
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.model.attention_switch import resolve_backend, set_attention
from fsdptrain.model.loading import build_full_model
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets, ValueLossSettings
from fsdptrain.train.experience import critic_values, policy_logprobs
from fsdptrain.train.optim import NonFiniteGuard, clip_grad_norm_
from fsdptrain.train.step import packed_policy_loss, packed_value_loss
from fsdptrain.train.step import MiniBatch, update_on_minibatch

CPU = torch.device("cpu")
CLIP, VALUE_CLIP, GRAD_CLIP, LR = 0.2, 0.2, 1.0, 1e-6
# The process's CPU time is the work done, whatever else the shared machine runs (one thread per process); wall time
# also counts the time other jobs held the cores.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--median-len", type=float, default=110.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--token-budget", type=int, default=TrainerConfig.token_budget, help="trainer.token_budget")
    parser.add_argument("--chunk-size", type=int, default=LossConfig.logprob_chunk_size, help="loss.logprob_chunk_size")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps of each side (after one warm-up each)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line at the end")
    return parser.parse_args(argv)


def lognormal_lengths(num_seqs: int, median: float, sigma: float, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randn(num_seqs, generator=gen, dtype=torch.float64) * sigma + math.log(median)
    return [int(min(max_len, max(8, round(math.exp(x))))) for x in draws.tolist()]


def _rollouts(lengths: list[int], vocab: int, seed: int) -> list[Rollout]:
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for length in lengths:
        ids = torch.randint(1, vocab, (length,), generator=gen).tolist()
        num_prompt = max(1, length // 4)
        out.append(Rollout(prompt_ids=ids[:num_prompt], response_ids=ids[num_prompt:], reward=0.0, group=0))
    return out


def _models(args) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=max(args.max_len, args.token_budget), tie_word_embeddings=False)
    policy = build_full_model("policy", path=None, config=config, seed=args.seed)
    critic = build_full_model("value", path=None, config=config, seed=args.seed + 1, backbone_from=policy)
    return policy, critic


def _adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


# ---------------------------------------------------------------------------------------------------------- packed


class PackedSide:
    """fsdptrain's experience and update functions on packed rows."""

    def __init__(self, policy, critic, rollouts, advantages_R, returns_R, args):
        self.policy, self.critic, self.rollouts = policy, critic, rollouts
        self.advantages_R, self.returns_R, self.args = advantages_R, returns_R, args
        self.backend = resolve_backend("auto", CPU, torch.float32)
        set_attention(policy, self.backend)
        set_attention(critic, self.backend)
        self.opts = (_adamw(policy), _adamw(critic))
        self.policy_settings = PolicyLossSettings(
            agg_mode="token-mean", clip_ratio_low=CLIP, clip_ratio_high=CLIP, clip_ratio_c=3.0, seq_level_ratio=False,
            kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0, chunk_size=args.chunk_size)
        self.value_settings = ValueLossSettings(agg_mode="token-mean", cliprange_value=VALUE_CLIP)

    def step(self) -> list[torch.Tensor]:
        budget = self.args.token_budget
        old_logprobs = policy_logprobs(self.policy, self.rollouts, temperature=1.0, chunk_size=self.args.chunk_size,
                                       token_budget=budget, device=CPU)
        old_values = critic_values(self.critic, self.rollouts, token_budget=budget, device=CPU)
        targets = [SeqTargets(old_logprobs=lp, advantages=a, old_values=v, returns=r)
                   for lp, a, v, r in zip(old_logprobs, self.advantages_R, old_values, self.returns_R)]
        batch = MiniBatch(prompts=[r.prompt_ids for r in self.rollouts],
                          responses=[r.response_ids for r in self.rollouts], targets=targets)
        for model, opt, loss_fn, settings in ((self.policy, self.opts[0], packed_policy_loss, self.policy_settings),
                                              (self.critic, self.opts[1], packed_value_loss, self.value_settings)):
            update_on_minibatch(model, opt, batch, loss_fn=loss_fn, settings=settings, dp_size=1,
                                loss_scale_factor=None, token_budget=budget, grad_clip=GRAD_CLIP,
                                guard=NonFiniteGuard(3), device=CPU)
        return old_logprobs


# ---------------------------------------------------------------------------------------------------------- padded


def _masked_mean(x_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
    return (x_BL * mask_BL).sum() / mask_BL.sum()


def _scatter_BL(values_R: list[torch.Tensor], mask_BL: torch.Tensor) -> torch.Tensor:
    out_BL = torch.zeros(mask_BL.shape, dtype=torch.float32)
    out_BL[mask_BL] = torch.cat(values_R).float()  # row-major: sequence by sequence, token by token
    return out_BL


class PaddedSide:
    """A TRL-style step: right-padded [B, L] batch, attention mask, full [B, L, V] logits, log_softmax + gather."""

    def __init__(self, policy, critic, rollouts, advantages_R, returns_R):
        self.policy, self.critic = policy, critic
        set_attention(policy, "sdpa")
        set_attention(critic, "sdpa")
        self.opts = (_adamw(policy), _adamw(critic))
        self.batch = pad_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts])
        self.mask_BL = self.batch.response_mask
        self.labels_BL = self.batch.labels.clamp(min=0)
        self.advantages_BL = _scatter_BL(advantages_R, self.mask_BL)
        self.returns_BL = _scatter_BL(returns_R, self.mask_BL)

    def _logp_BLV(self) -> torch.Tensor:
        logits_BLV = self.policy(input_ids=self.batch.input_ids, attention_mask=self.batch.attention_mask,
                                 use_cache=False).logits
        return torch.log_softmax(logits_BLV.float(), dim=-1)

    def _values_BL(self) -> torch.Tensor:
        return self.critic(input_ids=self.batch.input_ids, attention_mask=self.batch.attention_mask).logits[..., 0]

    def step(self) -> list[torch.Tensor]:
        with torch.no_grad():
            old_logprobs_BL = self._logp_BLV().gather(-1, self.labels_BL.unsqueeze(-1)).squeeze(-1)
            old_values_BL = self._values_BL()
        logp_BLV = self._logp_BLV()
        logprobs_BL = logp_BLV.gather(-1, self.labels_BL.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():  # logged, as TRL's PPO trainer does
            self.entropy = float(_masked_mean(-(logp_BLV.exp() * logp_BLV).sum(-1), self.mask_BL))
        ratio_BL = torch.exp(logprobs_BL - old_logprobs_BL)
        pg_BL = torch.maximum(-self.advantages_BL * ratio_BL,
                              -self.advantages_BL * ratio_BL.clamp(1.0 - CLIP, 1.0 + CLIP))
        self._optimize(self.policy, self.opts[0], _masked_mean(pg_BL, self.mask_BL))
        values_BL = self._values_BL()
        clipped_BL = old_values_BL + (values_BL - old_values_BL).clamp(-VALUE_CLIP, VALUE_CLIP)
        vf_BL = 0.5 * torch.maximum((values_BL - self.returns_BL).square(), (clipped_BL - self.returns_BL).square())
        self._optimize(self.critic, self.opts[1], _masked_mean(vf_BL, self.mask_BL))
        return [row[m] for row, m in zip(old_logprobs_BL, self.mask_BL)]

    @staticmethod
    def _optimize(model, opt, loss: torch.Tensor) -> None:
        loss.backward()
        clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------- driver


def main(argv=None) -> dict:
    args = _parse(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    lengths = lognormal_lengths(args.num_seqs, args.median_len, args.sigma, args.max_len, args.seed)
    rollouts = _rollouts(lengths, args.vocab, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 2)
    advantages_R = [torch.randn(len(r.response_ids), generator=gen) for r in rollouts]
    returns_R = [torch.randn(len(r.response_ids), generator=gen) for r in rollouts]
    policy, critic = _models(args)
    sides = {"padded": PaddedSide(copy.deepcopy(policy), copy.deepcopy(critic), rollouts, advantages_R, returns_R),
             "packed": PackedSide(policy, critic, rollouts, advantages_R, returns_R, args)}
    real, padded_tokens = sum(lengths), len(lengths) * max(lengths)
    print(f"model: Qwen2 {args.layers} x {args.hidden}, V {args.vocab}, fp32, policy + critic, "
          f"{torch.get_num_threads()} thread(s); packed on {sides['packed'].backend}, chunk {args.chunk_size}, "
          f"budget {args.token_budget}")
    print(f"lengths ({args.num_seqs}, median {args.median_len:g}, sigma {args.sigma}, seed {args.seed}): "
          f"{sorted(lengths)}; mean {real / len(lengths):.1f}; padding ceiling {padded_tokens}/{real} "
          f"= {padded_tokens / real:.2f}x")

    timings: dict[str, dict[str, list[float]]] = {clock: {name: [] for name in sides} for clock in CLOCKS}
    for repeat in range(args.repeats + 1):
        first = {}
        for name, side in sides.items():
            start = {clock: fn() for clock, fn in CLOCKS.items()}
            first[name] = side.step()
            elapsed = {clock: fn() - start[clock] for clock, fn in CLOCKS.items()}
            for clock in CLOCKS:
                if repeat:
                    timings[clock][name].append(elapsed[clock])
            print(f"  {'warm-up' if not repeat else f'repeat {repeat}'} {name}: {elapsed['cpu']:.2f} s CPU, "
                  f"{elapsed['wall']:.2f} s wall", flush=True)
        if not repeat:  # same weights on both sides before the first optimizer step
            diff = max(float((a - b).abs().max()) for a, b in zip(first["padded"], first["packed"]))
            print(f"  experience log-probs, packed vs padded, same weights: max |diff| {diff:.2e}")
            assert diff < 1e-4, "the two sides do not compute the same log-probs"
    seconds = {clock: {name: statistics.median(t) for name, t in per.items()} for clock, per in timings.items()}
    speedup = {clock: s["padded"] / s["packed"] for clock, s in seconds.items()}
    result = {"seconds": seconds, "speedup": speedup, "ceiling": padded_tokens / real, "mean_len": real / len(lengths),
              "max_len": max(lengths), "logprob_max_diff": diff}
    for clock, s in seconds.items():
        print(f"median step, {clock}: padded {s['padded']:.2f} s, packed {s['packed']:.2f} s; speed-up "
              f"{speedup[clock]:.2f}x (padding ceiling {result['ceiling']:.2f}x)")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
