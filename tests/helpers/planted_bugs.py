"""Bugs from the anchors' trainers, planted into the product for check-metrics' tests to catch.

Each ``plant_*`` takes the setter to use: ``monkeypatch.setattr`` in one process (tests/unit), plain ``setattr`` in a
``sitecustomize`` module on the ranks' Python path (tests/e2e).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from fsdptrain.train import experience, optim, rl, step


@torch.no_grad()
def clip_by_local_shards(parameters, max_norm):
    """SkyRL #211: the grad norm over this rank's shards only, so each rank logs and clips by its own norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([g.to_local() if isinstance(g, DTensor) else g for g in grads]).float()
    if max_norm is not None and max_norm > 0 and max_norm / (float(norm) + 1e-6) < 1:
        for g in grads:
            g.mul_(max_norm / (float(norm) + 1e-6))
    return norm


def plant_grad_norm_over_local_shards(set_attr=setattr) -> None:
    set_attr(optim, "clip_grad_norm_", clip_by_local_shards)
    set_attr(step, "clip_grad_norm_", clip_by_local_shards)


def plant_normaliser_over_the_whole_step(set_attr=setattr) -> None:
    """TRL #6024: every mini-batch's loss normalised by the counts of the whole step, not of the mini-batch."""
    whole, update, normalizers = [], rl.Trainer.update, step.global_normalizers

    def update_whole(self, batches, on_policy):
        whole.append(step.MiniBatch([p for b in batches for p in b.prompts], [r for b in batches for r in b.responses],
                                    [t for b in batches for t in b.targets]))
        try:
            return update(self, batches, on_policy)
        finally:
            whole.clear()

    set_attr(rl.Trainer, "update", update_whole)
    set_attr(step, "global_normalizers", lambda batch, **kw: normalizers(whole[0] if whole else batch, **kw))


def plant_sequence_weight_from_mean_log_ratio(set_attr=setattr) -> None:
    """TRL #5814: a sequence's importance weight from the mean of its token log-ratios (a geometric mean of the
    ratios), not their sum (the product)."""
    weights = experience.rollout_correction_weights

    def mean_not_sum(old, behaviour, mask, *, mode, level, cap, low=None, cu_seqlens=None):
        num_tokens = mask.sum(-1, keepdim=True).clamp(min=1)
        return weights(old, old - (old - behaviour) / num_tokens, mask, mode=mode, level=level, cap=cap, low=low,
                       cu_seqlens=cu_seqlens)

    set_attr(experience, "rollout_correction_weights", mean_not_sum)


def plant_loss_on_tool_tokens(set_attr=setattr) -> None:
    """A multi-turn trainer that packs its rows from the prompt and response lengths alone: the loss (and every metric
    of the update) also scores the tokens a tool wrote."""
    pack = step.pack_sequences

    def by_lengths(prompts, responses, indices=None, *, response_masks=None, **kw):
        return pack(prompts, responses, indices, **kw)

    set_attr(step, "pack_sequences", by_lengths)


def plant_tool_tokens_in_the_normaliser(set_attr=setattr) -> None:
    """The global token count taken from the response lengths, not the mask: token-mean divides by the tools' tokens
    too (the loss itself still reads the mask)."""

    def by_lengths(batch):
        return sum(len(r) for r in batch.responses), sum(1 for r in batch.responses if r)

    set_attr(step, "local_counts", by_lengths)


def plant_rejected_tokens_in_the_normaliser(set_attr=setattr) -> None:
    """The normalisers counted from the rollouts' masks, before rejection sampling removed tokens (as if they were
    counted before the experience pass): the rejected tokens leave the loss but not its denominator."""
    before: dict[int, torch.Tensor] = {}
    rejected, counts = experience.rejected, step.local_counts

    def remembering(old_R, behaviour_R, masks, *args, **kw):
        kept, metrics = rejected(old_R, behaviour_R, masks, *args, **kw)
        for keep, mask, old in zip(kept, masks, old_R):
            before[id(keep)] = mask if mask is not None else torch.ones(old.numel(), dtype=torch.bool)
        return kept, metrics

    def unrejected(batch):
        masks = [before.get(id(t.response_mask), t.response_mask) for t in batch.targets]
        counted = [len(r) if m is None else int(m.sum()) for r, m in zip(batch.responses, masks)]
        return sum(counted), sum(1 for n in counted if n > 0)

    set_attr(experience, "rejected", remembering)
    set_attr(step, "local_counts", unrejected)


def plant_normaliser_per_cp_rank(set_attr=setattr) -> None:
    """The CP normaliser bug of the anchors' trackers (verl #6836's class): every rank of a CP group counts the
    tokens and sequences of the batch it holds, so the global counts hold each token cp times."""
    normalizers = step.global_normalizers
    set_attr(step, "global_normalizers", lambda batch, *, context=None, **kw: normalizers(batch, **kw))


def plant_position_ids_restarting_per_chunk(set_attr=setattr) -> None:
    """Context parallelism's position ids restarting at 0 in each chunk a rank holds, instead of the row's."""
    from fsdptrain.distributed.context_parallel import ContextShard

    model_inputs = ContextShard.model_inputs

    def restarting(self, packed):
        inputs = model_inputs(self, packed)
        chunks = [torch.arange(end - start, device=packed.position_ids.device) for start, end in self.split.chunks]
        inputs["position_ids"] = torch.cat(chunks).view(1, -1)
        return inputs

    set_attr(ContextShard, "model_inputs", restarting)


def plant_teacher_logprobs_shifted_by_one(set_attr=setattr) -> None:
    """Distillation: the teacher's log-prob of token t + 1 read for token t (a label misaligned by one position)."""
    teacher = experience.teacher_logprobs

    def shifted(model, rollouts, **kw):
        out = teacher(model, rollouts, **kw)
        return None if out is None else [torch.roll(values_R, -1) for values_R in out]

    set_attr(experience, "teacher_logprobs", shifted)


def plant_micro_batch_normalised_by_its_own_tokens(set_attr=setattr) -> None:
    """TRL #6024, ms-swift #10117 (the shape of it): each micro-batch's loss divided by its own count of trained
    tokens, a mean per micro-batch, instead of the mini-batch's global count: the loss then depends on the split."""
    import dataclasses

    accumulate = step.accumulate_gradients

    def own_counts(model, batch, *, loss_fn, norms, **kwargs):
        def per_pack(model, packed, targets, *, norms, **rest):
            own = int(packed.response_mask.sum())
            return loss_fn(model, packed, targets, norms=dataclasses.replace(norms, global_num_tokens=own), **rest)

        return accumulate(model, batch, loss_fn=per_pack, norms=norms, **kwargs)

    set_attr(step, "accumulate_gradients", own_counts)


# ---- before the layouts: every layout is fed the same result, so only the reference's own cut and rewards from the
# raw generation output and the raw reward values (fsdptrain/check/raw_reference.py) can catch these

def plant_eos_cut_off_the_response(set_attr=setattr) -> None:
    """A response cut one token short: a finished response loses its EOS (the policy is never trained to stop).
    Planted in both engines' cut: generate's ``split_response`` and the continuous engine's ``Generated`` records."""
    from fsdptrain.generation import generate

    split = generate.split_response

    def without_eos(generated, *, eos_id):
        response, truncated = split(generated, eos_id=eos_id)
        return (response if truncated else response[:-1]), truncated

    set_attr(generate, "split_response", without_eos)
    _plant_finished(set_attr, lambda f: dataclasses.replace(f, new_ids=f.new_ids[:-1], logprobs=f.logprobs[:-1])
                    if f.ended else f)


def plant_capped_response_not_truncated(set_attr=setattr) -> None:
    """The continuous engine reports a row that reached its cap as ended (as if on EOS): ``truncated`` is False for
    every response, so overlong filtering and ``response_length/clip_ratio`` never see one."""
    _plant_finished(set_attr, lambda f: dataclasses.replace(f, ended=True))


def _plant_finished(set_attr, change) -> None:
    """``change`` applied to each row the continuous engine hands back (``ContinuousEngine._leave``)."""
    from fsdptrain.generation.continuous import ContinuousEngine

    leave = ContinuousEngine._leave
    set_attr(ContinuousEngine, "_leave", lambda self: [change(f) for f in leave(self)])


def plant_eos_left_out_of_the_response_mask(set_attr=setattr) -> None:
    """A single-turn sampler that marks a finished response's EOS as not the policy's (as if the template wrote it):
    its loss, normalisers and advantages skip the token that ends the response."""
    from fsdptrain.rollout.single_turn import SingleTurnSampler

    sample = SingleTurnSampler.sample

    def masking_eos(self, *args, **kwargs):
        samples = sample(self, *args, **kwargs)
        eos = self.tokenizer.eos_token_id
        masks = [[0 if j == len(ids) - 1 and token == eos else 1 for j, token in enumerate(ids)]
                 for ids in samples.response_ids]
        return dataclasses.replace(samples, response_masks=masks)

    set_attr(SingleTurnSampler, "sample", masking_eos)


def plant_reward_clipped_before_the_advantages(set_attr=setattr) -> None:
    """A clip range meant for normalised scores applied to the raw reward: the outcome reward clamped to [-0.25,
    0.25] before the advantages."""
    from fsdptrain.rewards import runner

    combine = runner._combine

    def clipped(raw, functions, timed_out):
        scores = combine(raw, functions, timed_out)
        return dataclasses.replace(scores, total=[min(max(t, -0.25), 0.25) for t in scores.total])

    set_attr(runner, "_combine", clipped)


def plant_current_weights_as_behaviour(set_attr=setattr) -> None:
    """An asynchronous trainer whose experience takes the behaviour log-probs of stale rollouts from its own forward
    at the current weights (the version it trains) instead of the generating forward's: every ratio against the
    behaviour policy is 1, so neither the loss's old log-probs nor a rollout correction sees the staleness."""
    from fsdptrain.distributed import world

    make = rl.make_targets

    def current_as_behaviour(models, rollouts, settings, *, device, **kw):
        if world.any_flag(any(r.behaviour_logprobs is not None for r in rollouts)):  # collective forward
            current = experience.policy_logprobs(models.policy, rollouts, temperature=settings.temperature,
                                                 chunk_size=settings.chunk_size, token_budget=settings.token_budget,
                                                 device=device)
            rollouts = [dataclasses.replace(r, behaviour_logprobs=c.tolist()) if r.behaviour_logprobs is not None
                        else r for r, c in zip(rollouts, current)]
        return make(models, rollouts, settings, device=device, **kw)

    set_attr(rl, "make_targets", current_as_behaviour)


def plant_stale_rollouts_taken_as_on_policy(set_attr=setattr) -> None:
    """A separate placement that hands its generators' rollouts to the experience without their generation log-probs
    at any staleness, as if the generators held the trainer's weights: the old pass at the current weights then
    stands in for the behaviour policy."""
    from fsdptrain.rollout import prompt_source

    set_attr(prompt_source, "stale_behaviour", lambda rollouts, *, max_staleness: rollouts)


def plant_kl_penalty_sign_flipped_in_the_reward(set_attr=setattr) -> None:
    """The KL-in-reward penalty added instead of subtracted: r_t + coef * (old_t - ref_t), a bonus for leaving the
    reference. On the batch as generated the reference is the policy and the term is 0 either way."""
    rewards = experience.token_rewards

    def flipped(rollouts, *, kl_R, kl_coef, masks=None):
        return rewards(rollouts, kl_R=None if kl_R is None else [-k for k in kl_R], kl_coef=kl_coef, masks=masks)

    set_attr(experience, "token_rewards", flipped)


def plant_kl_penalty_coefficient_applied_twice(set_attr=setattr) -> None:
    """The KL-in-reward coefficient applied twice (a controller's coefficient times the configured one): r_t - coef^2
    * (old_t - ref_t)."""
    rewards = experience.token_rewards

    def squared(rollouts, *, kl_R, kl_coef, masks=None):
        return rewards(rollouts, kl_R=kl_R, kl_coef=kl_coef * kl_coef, masks=masks)

    set_attr(experience, "token_rewards", squared)


def plant_moe_aux_loss_per_micro_batch(set_attr=setattr) -> None:
    """An MoE trainer that adds transformers' load-balancing loss of each forward (its own expert counts, router
    probabilities and token count: Switch's means over one micro-batch), not its share of the mini-batch's."""
    from fsdptrain.rl.moe_aux_loss import whole_batch_aux_loss
    from fsdptrain.train import pack_losses

    def own_value(logits_LTE, weights_T, norms, *, dp_size=1):
        k = norms.expert_counts_LE[0].sum() / norms.num_tokens  # every counted token chose k experts
        indices = [torch.topk(x.detach(), int(round(float(k))), dim=-1).indices for x in logits_LTE]
        return whole_batch_aux_loss(logits_LTE, indices, weights_T) * dp_size

    set_attr(pack_losses, "aux_loss_share", own_value)


def plant_moe_aux_loss_counts_padding(set_attr=setattr) -> None:
    """transformers' load-balancing loss without its attention mask: every routed position counts, padding too."""
    from fsdptrain.data.packing import PaddedBatch
    from fsdptrain.train import pack_losses

    weights = pack_losses.route_weights

    def every_position(batch):
        if isinstance(batch, PaddedBatch):
            return torch.ones(batch.attention_mask.numel(), dtype=torch.float64)
        return torch.ones_like(weights(batch)) if len(weights(batch)) else weights(batch)

    set_attr(pack_losses, "route_weights", every_position)
