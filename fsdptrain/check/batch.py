"""check-metrics, part 1: the models and the one mini-batch of experience every layout is checked on.

The mini-batch is made exactly as ``fsdptrain train`` makes its first one (the same
:class:`~fsdptrain.train.rl.Trainer`,
experience source and collective experience passes), from the resolved config with two changes that only shrink it:
``rollout.prompts_per_step`` is capped at ``check.num_prompts`` and the step has one mini-batch. Each rank keeps its
own share (the product path's input) and also gathers the whole mini-batch, which every rank runs in the single-process
layouts (all forwards of an FSDP model are collective, so every rank runs the same ones in lockstep).

Two fixtures make sentinel bugs visible, both documented in docs/check-metrics.md (always on; a test turns one off
with :func:`make_batch`'s arguments):
- ``masked_fixture``: a prompt-only sequence (no response token) joins the batch, on the last rank. A pack,
  micro-batch or rank that holds only it has empty extrema; a merge that reports an empty MIN/MAX as 0.0 then wins.
- ``negative_values``: a forward hook on the critic's value head subtracts a constant (the batch's largest value
  plus 1, measured before the experience is made), so every value is <= -1 and a 0.0 sentinel would win
  ``values_max``. (The policy's ratios are about 1 > 0, so ``probs_ratio_min`` already exposes a MIN sentinel.)
- ``mask_holes`` (the multi-turn fixture): when no rollout carries a ``response_mask``, two thirds of the sequences
  get one (:func:`with_tool_segments`): some with two tool segments inside the response, some with one inside and
  one cut at the end (trailing zeros), as a multi-turn tool-calling rollout would hold; the other third keep none
  (the single-turn path). A loss, normaliser, metric or estimator that reads lengths instead of the mask then
  differs from the reference, which reads the mask itself (``CheckBatch.policy_masks``, ``counted``).

The reference's own inputs before the layouts (:mod:`fsdptrain.check.raw_reference`): while the source makes the
rollouts, the decoder's ``decode`` calls (each request and the tokens the engine drew) are recorded through its
``recording`` hook; the reference cuts the prompts and responses out of that raw
output itself, takes the policy's tokens by its own rule (:func:`reference_policy`) and adds the reward functions' raw
values up itself (:func:`reference_sequences`). Its rollout facts, the oracle's scores and its masks are those, and
``CheckBatch.raw_checks`` compares the product's prompts, responses and rewards with them.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed
from omegaconf import DictConfig, OmegaConf

from fsdptrain.check.compare import Check
from fsdptrain.check.draft_check import check_vocab
from fsdptrain.check.precision import checked_precision, in_checked_precision, tolerances
from fsdptrain.check.progress import say
from fsdptrain.check.staleness import ON_POLICY_NOTE, as_colocated, behaviour_checks, made_stale, separate_staleness
from fsdptrain.check.raw_reference import (
    RawSequence,
    decoded_logprobs,
    decoded_sequences,
    raw_checks,
    recording_decoders,
    reference_rewards,
)
from fsdptrain.config import ConfigError, reward_specs
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import reduce_metrics
from fsdptrain.registry.constants import LOG_RATIO_CLAMP
from fsdptrain.metrics.typed import finalize
from fsdptrain.rl.fused_loss import SeqTargets
from fsdptrain.train.drafter_setup import draft_vocab_size
from fsdptrain.train.experience import critic_values, policy_logprobs
from fsdptrain.train.rl import Trainer
from fsdptrain.train.step import MiniBatch

VALUE_MARGIN = 1.0  # after the shift every value is at most -VALUE_MARGIN
BEHAVIOUR_SEED, BEHAVIOUR_SPREAD = 20_260_127, 1.0  # planted behaviour log-probs: old +- 1 (weights in [0.37, 2.7])


@dataclass(frozen=True)
class RolloutFacts:
    """What the step's rollout metrics are made of, for one sequence."""

    reward: float
    num_prompt_tokens: int
    num_response_tokens: int
    truncated: bool
    num_policy_tokens: int
    """Response tokens the policy sampled (the ones ``response_length/*`` counts)."""


@dataclass(frozen=True)
class Rejection:
    """The rejection sampling the checked batch's mask follows: by ratio, level (token, sequence, geometric; none)
    and [low, high]; by divergence, verl's option name (token_k2, ..., seq_max_k3; none) and its max."""

    level: str
    low: float
    high: float
    divergence: str = "none"
    divergence_max: Optional[float] = None


@dataclass(frozen=True)
class IsCorrection:
    """The rollout correction the checked batch's importance weights follow: mode (tis, mis), level, cap C and
    lower bound L (mis only; None: none)."""

    mode: str
    level: str
    cap: float
    low: Optional[float] = None


@dataclass
class CheckBatch:
    """The checked mini-batch: ``full`` (every rank, the same global order) and ``local`` (this rank's share).

    ``rollouts``/``facts`` describe the real sequences (not the fixture): this rank's rollouts and every rank's facts.
    ``on_policy`` is False when the rollouts carry behaviour log-probs. ``value_shift`` is the constant added to the
    critic's outputs (None when not shifted).
    """

    full: MiniBatch
    local: MiniBatch
    rollouts: list[Rollout]
    facts: list[RolloutFacts]
    on_policy: bool
    value_shift: Optional[float]
    has_fixture: bool
    scores: list[float]
    """The real sequences' outcome scores and prompt groups, in ``full``'s order (the experience oracle's inputs)."""
    groups: list[int]
    local_index: list[int]
    """``local``'s sequences as positions in ``full``, in ``local``'s order."""

    behaviour: Optional[list[torch.Tensor]] = None
    """With a rollout correction: the behaviour log-probs each of ``full``'s sequences' weights came from (its old
    log-probs when the rollout carried none); None without one. ``correction`` says how they were made."""
    correction: Optional[IsCorrection] = None
    experience: dict[str, float] = dataclasses.field(default_factory=dict)
    """The step's experience metrics as ``fsdptrain train`` logs them (``experience/rollout_is_*``, ``rollout_corr/*``,
    rank-reduced)."""
    planted_behaviour: bool = False
    """True when the check gave the rollouts behaviour log-probs (old + seeded noise) so the weights are not 1."""
    carried_behaviour: Optional[list[Optional[torch.Tensor]]] = None
    """The behaviour log-probs each of ``full``'s real sequences carried into the experience (None for one that
    carried none; planted ones included): what ``rollout_corr/*`` compares with the old log-probs. None when no
    sequence carried any."""
    policy_masks: Optional[list[list[bool]]] = None
    """Per sequence of ``full``, its policy's response tokens by the reference's rule (:func:`reference_policy`:
    the check's fixture mask, every token of a single-turn sample, else the rollout's own; the prompt-only
    fixture's is empty): the reference's mask, never the product's."""
    counted: Optional[list[list[bool]]] = None
    """``policy_masks`` less the tokens the reference rejects (:func:`reference_counted` with
    ``rejection``): the tokens the reference's losses, counts and metrics read."""
    rejection: Optional[Rejection] = None
    trainer_old: Optional[list[torch.Tensor]] = None
    """With rejection: the trainer's own old log-probs of ``full``'s sequences (the rejection's numerator)."""
    raw_checks: list[Check] = dataclasses.field(default_factory=list)
    """The product's prompts, responses and rewards against the reference's own from the raw generation output and
    the raw reward values (:mod:`fsdptrain.check.raw_reference`); with a stale batch, its behaviour log-probs against
    the recorded generation ones (:mod:`fsdptrain.check.staleness`)."""
    raw_notes: list[str] = dataclasses.field(default_factory=list)
    """What the reference could not recompute from the raw output on this config (it took the product's)."""

    def with_targets(self, targets: list) -> "CheckBatch":
        """The same batch with ``full``'s targets replaced (``local``'s follow through ``local_index``)."""
        full = MiniBatch(self.full.prompts, self.full.responses, list(targets))
        local = MiniBatch(self.local.prompts, self.local.responses, [targets[i] for i in self.local_index])
        return dataclasses.replace(self, full=full, local=local)

    def counted_masks(self) -> list[list[bool]]:
        """``counted``, or every response token of ``full`` when the batch has no mask."""
        return self.counted if self.counted is not None else [[True] * len(r) for r in self.full.responses]

    def policy_token_masks(self) -> list[list[bool]]:
        """``policy_masks``, or every response token of ``full`` when the batch has no mask."""
        return self.policy_masks if self.policy_masks is not None else [[True] * len(r) for r in self.full.responses]


@dataclass(frozen=True)
class UpdateShape:
    """Mini-batches per step and epochs of the checked update, and whether they are the configured ones."""

    mini_batches: int
    epochs: int
    configured: bool

    @property
    def layout(self) -> str:
        return f"mini-batches={self.mini_batches} x epochs={self.epochs}"


def update_shape(cfg: DictConfig, num_prompts: int) -> UpdateShape:
    """The configured mini-batches and epochs when either is above 1, else 2 and 2 (the battery), with the
    mini-batch count lowered to a divisor of the checked ``num_prompts`` prompt groups when needed."""
    mini_batches, epochs = cfg.trainer.mini_batches_per_step, cfg.algorithm.ppo_epochs
    configured = mini_batches > 1 or epochs > 1
    mini_batches = mini_batches if configured else 2
    epochs = epochs if configured else 2
    while mini_batches > 1 and num_prompts % mini_batches:
        mini_batches -= 1
    return UpdateShape(mini_batches, epochs, configured)


@dataclass
class CheckSession:
    """Everything the layouts need: the config actually checked, the trainer (models, settings) and the batch."""

    cfg: DictConfig
    trainer: Trainer
    batch: CheckBatch
    update: Optional[UpdateShape] = None
    """The mini-batches and epochs of the update pass (:mod:`fsdptrain.check.update_pass`)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the checked precision changed (:func:`fsdptrain.check.precision.in_checked_precision`)."""

    @property
    def world_size(self) -> int:
        return self.trainer.info.world_size


def check_config(cfg: DictConfig, world_size: int) -> DictConfig:
    """A copy of ``cfg`` whose step is the checked mini-batch: ``min(check.num_prompts, prompts_per_step)`` prompt
    groups and one mini-batch (the update pass takes its mini-batches and epochs from :func:`update_shape`), and
    ``check.rtol``/``check.atol`` resolved (:func:`fsdptrain.check.precision.tolerances`). The caller's config is not
    modified."""
    num_prompts = min(cfg.check.num_prompts, cfg.rollout.prompts_per_step)
    if num_prompts < world_size:
        raise ConfigError(f"check.num_prompts={cfg.check.num_prompts} must be at least the number of ranks "
                          f"({world_size}): every rank needs a prompt group")
    checked = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    checked.rollout.prompts_per_step = num_prompts
    checked.trainer.mini_batches_per_step = 1
    checked.check.rtol, checked.check.atol = tolerances(cfg)  # the numbers every comparison reads
    return checked


def value_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The value model's head: its last ``nn.Linear`` with one output (transformers' token-classification score)."""
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1]
    return heads[-1] if heads else None


def shift_values_below_zero(trainer: Trainer, rollouts: list[Rollout]) -> Optional[float]:
    """Add ``-(largest value over the global batch + VALUE_MARGIN)`` to the critic's outputs (collective).

    Returns the shift, or None when the critic has no recognisable value head (then values keep both signs).
    """
    critic = trainer.models.critic
    head = value_head(critic)
    if head is None:
        return None
    values = critic_values(critic, rollouts, token_budget=trainer.cfg.trainer.token_budget, device=trainer.device)
    local = max((float(v.max()) for v in values if v.numel()), default=-float("inf"))
    largest = float(world.all_reduce_max(torch.tensor([local], dtype=torch.float64))[0])
    shift = -(largest + VALUE_MARGIN)
    head.register_forward_hook(lambda _module, _inputs, output: output + shift)
    return shift


def _fixture(prompt_ids: list[int]) -> tuple[list[int], list[int], SeqTargets]:
    """A prompt-only sequence: a real prompt, no response token, empty targets."""
    empty = torch.zeros(0, dtype=torch.float32)
    targets = SeqTargets(old_logprobs=empty, advantages=empty, ref_logprobs=empty, old_values=empty, returns=empty,
                         is_weights=empty)
    return list(prompt_ids), [], targets


def _append(batch: MiniBatch, prompt: list[int], response: list[int], target: SeqTargets) -> None:
    """One more sequence at the end of ``batch`` (with no recorded routes, where its others carry theirs)."""
    batch.prompts.append(prompt)
    batch.responses.append(response)
    batch.targets.append(target)
    if batch.routes:
        batch.routes.append(None)


def _all_gather(obj) -> list:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


@dataclass
class Sampled:
    """This rank's rollouts as the source made them (with the multi-turn fixture when ``fixture``), each one's
    prompt, response and reward as the product made them and as the reference makes them from the raw output
    (``recut``: the reference cut the responses itself), and the reference's rule for the policy's tokens."""

    rollouts: list[Rollout]
    product: list[RawSequence]
    reference: list[RawSequence]
    recut: bool
    fixture: bool
    single_turn: bool
    generated: list[list[float]]
    """Per rollout, its tokens' log-probs as the generating forward computed them: as the recorder saw the engine
    report them (:func:`decoded_logprobs`), else (a multi-turn sampler) the rollout's own ``generation_logprobs``."""

    def policy(self, rollouts: list[Rollout], lengths: list[int]) -> list[list[bool]]:
        """:func:`reference_policy` over responses of ``lengths``."""
        return reference_policy(rollouts, lengths, fixture=self.fixture, single_turn=self.single_turn)

    def facts(self, rollouts: list[Rollout]) -> list[RolloutFacts]:
        """The reference's rollout facts of this rank's sequences: its own prompts, responses, truncation, rewards
        and policy tokens."""
        policy = self.policy(rollouts, [len(raw.response_ids) for raw in self.reference])
        # a response ending neither at EOS nor at the cap (truncated None) already fails the raw check: no EOS
        return [RolloutFacts(reward_of(raw, r), len(raw.prompt_ids), len(raw.response_ids), raw.truncated is not False,
                             sum(m))
                for raw, r, m in zip(self.reference, rollouts, policy)]


def _sample(trainer: Trainer, *, mask_holes: bool) -> Sampled:
    """This rank's rollouts of the first step with ``generate`` and the continuous engine recorded (collective), and
    the reference's own sequences (:func:`reference_sequences`)."""
    info = trainer.info
    with recording_decoders() as runs:
        rollouts = trainer.source.rollouts(trainer.models, 0, rank=info.rank, world_size=info.world_size,
                                           device=trainer.device)
    product = [RawSequence(list(r.prompt_ids), list(r.response_ids), r.truncated, float(r.reward)) for r in rollouts]
    reference, recut = reference_sequences(trainer, rollouts, runs)
    fixture = mask_holes and all(r.response_mask is None for r in rollouts)
    generated = decoded_logprobs(runs, [len(r.response_ids) for r in rollouts])
    if generated is None:
        generated = [list(r.generation_logprobs or []) for r in rollouts]
    return Sampled(with_tool_segments(rollouts) if fixture else rollouts, product, reference, recut, fixture,
                   writes_every_token(trainer.cfg), generated)


def make_batch(trainer: Trainer, *, masked_fixture: bool = True, negative_values: bool = True,
               mask_holes: bool = True, staleness: int = 0) -> CheckBatch:
    """This rank's rollouts and experience (collective, as in training), the fixtures, and the gathered full batch;
    ``staleness`` k > 0: the experience made k versions after the sampling weights (fsdptrain/check/staleness.py)."""
    info = trainer.info
    sampled = _sample(trainer, mask_holes=mask_holes)
    rollouts = made_stale(trainer, sampled.rollouts, max_staleness=staleness)
    shift = None
    if trainer.models.critic is not None and negative_values:
        shift = shift_values_below_zero(trainer, rollouts)
    trainer.skip_old_passes = False  # the oracle compares against recomputed old log-probs and values
    targets, facts = trainer.make_experience(rollouts)
    alg = trainer.cfg.algorithm
    correction = (IsCorrection(alg.rollout_correction, alg.rollout_correction_level, alg.rollout_correction_cap,
                               alg.rollout_correction_low) if alg.rollout_correction != "none" else None)
    rejection = (Rejection(alg.rollout_rejection, alg.rollout_rejection_low, alg.rollout_rejection_high,
                           alg.rollout_rejection_divergence, alg.rollout_rejection_divergence_max)
                 if alg.rollout_rejection != "none" or alg.rollout_rejection_divergence != "none" else None)
    planted = (correction is not None or rejection is not None) and all(r.behaviour_logprobs is None for r in rollouts)
    if planted:  # weights of exactly 1 would prove nothing: a behaviour policy off by seeded noise, and again
        rollouts = with_behaviour(rollouts, [t.old_logprobs for t in targets], seed=BEHAVIOUR_SEED + info.rank)
        targets, facts = trainer.make_experience(rollouts)
    trainer_old = None
    if rejection is not None:  # the trainer's own old log-probs (the targets hold the behaviour's without a correction)
        exp = trainer.experience_settings
        trainer_old = policy_logprobs(trainer.models.policy, rollouts, temperature=exp.temperature,
                                      chunk_size=exp.chunk_size, token_budget=exp.token_budget, device=trainer.device)
    experience = finalize(reduce_metrics(facts["metrics"])) if facts["metrics"] else {}
    (local,) = trainer.minibatches(rollouts, targets)
    behaviour = [torch.tensor(r.behaviour_logprobs, dtype=torch.float32) if r.behaviour_logprobs is not None
                 else t.old_logprobs for r, t in zip(rollouts, targets)]
    carried = [torch.tensor(r.behaviour_logprobs, dtype=torch.float32) if r.behaviour_logprobs is not None else None
               for r in rollouts]
    policy = sampled.policy(rollouts, [len(r.response_ids) for r in rollouts])
    stale_checks, stale_notes = behaviour_checks(trainer, rollouts, targets, carried, sampled.generated, policy,
                                                 corrected=correction is not None, max_staleness=staleness)
    olds = trainer_old if trainer_old is not None else [None] * len(rollouts)
    entries = [((r.group, k), p, resp, t, info.rank, reward_of(raw, r), b, m, o, c, mine, raw)
               for k, (r, p, resp, t, b, m, o, c, mine, raw) in
               enumerate(zip(rollouts, local.prompts, local.responses, local.targets, behaviour, policy, olds,
                             carried, sampled.product, sampled.reference))]
    gathered = sorted((e for part in _all_gather(entries) for e in part), key=lambda e: e[0])
    full = MiniBatch([e[1] for e in gathered], [e[2] for e in gathered], [e[3] for e in gathered])
    scores = [float(e[5]) for e in gathered]
    groups = [int(e[0][0]) for e in gathered]
    local_index = sorted((i for i, e in enumerate(gathered) if e[4] == info.rank), key=lambda i: gathered[i][0][1])
    full_behaviour = [e[6] for e in gathered]
    policy_masks = [e[7] for e in gathered]
    full_old = [e[8] for e in gathered]
    full_carried = [e[9] for e in gathered]
    found_raw = raw_checks([e[10] for e in gathered], [e[11] for e in gathered], atol=trainer.cfg.check.atol,
                           rtol=trainer.cfg.check.rtol, responses_recut=sampled.recut)
    add_fixture = masked_fixture
    if add_fixture:
        prompt, response, target = _fixture(full.prompts[0])
        full_behaviour.append(torch.zeros(0, dtype=torch.float32))
        policy_masks.append([])
        full_old.append(torch.zeros(0, dtype=torch.float32))
        _append(full, prompt, response, target)
        if info.rank == info.world_size - 1:
            local_index.append(full.num_seqs - 1)
            _append(local, prompt, response, target)
    all_facts = [f for part in _all_gather(sampled.facts(rollouts)) for f in part]
    # Planted behaviour log-probs leave the old ones the trainer's own under a correction, so the ratio is still 1
    # (on-policy); without one (rejection alone) they become the old log-probs and the batch is off-policy.
    return CheckBatch(full=full, local=local, rollouts=rollouts, facts=all_facts,
                      on_policy=facts["on_policy"] or (planted and correction is not None), value_shift=shift, has_fixture=add_fixture,
                      scores=scores, groups=groups, local_index=local_index,
                      behaviour=full_behaviour if correction is not None or rejection is not None else None,
                      correction=correction, experience=experience, planted_behaviour=planted,
                      policy_masks=policy_masks,
                      counted=reference_counted(policy_masks, full_old, full_behaviour, rejection),
                      rejection=rejection, trainer_old=full_old if rejection is not None else None,
                      carried_behaviour=full_carried if any(c is not None for c in full_carried) else None,
                      raw_checks=found_raw + stale_checks,
                      raw_notes=([] if sampled.recut else [NOT_RECUT]) + stale_notes)


NOT_RECUT = ("the responses are the sampler's own (the multi-turn sampler or offline rollouts): "
             "the reference did not cut them from the raw generation output")


def writes_every_token(cfg: DictConfig) -> bool:
    """Whether the policy wrote every response token (a single-turn sampler: no tools, no environment, not offline
    rollouts)."""
    return (cfg.data.source != "jsonl" and cfg.rollout.tools is None and cfg.rollout.environment is None
            and cfg.rollout.agent is None)


def reference_sequences(trainer: Trainer, rollouts: list[Rollout], runs) -> tuple[list, bool]:
    """This rank's sequences as the reference makes them (:mod:`fsdptrain.check.raw_reference`), and whether it cut
    the responses itself: from the recorded ``decode`` call (``runs``) of a single-turn sampler; otherwise the
    product's prompts and responses. The rewards come from the functions' raw values and the configured weights whenever
    the source scored the rollouts (an environment's ``get_reward`` with the weight the sampler gave it; the reward
    models' scaled total as the source made it); None for offline rollouts."""
    cfg, source = trainer.cfg, trainer.source
    rewards = None
    scores = getattr(source, "last_scores", None)
    if scores is not None:
        specs = reward_specs(cfg)
        weights = [float(w) for w in cfg.reward.weights] if cfg.reward.weights is not None else [1.0] * len(specs)
        weights += [f.weight for f in source.functions[len(specs):]]
        models = source.last_model_scores.total_N.tolist() if trainer.models.reward_models else None
        rewards = reference_rewards(scores.raw, [f.name for f in source.functions], weights, models, len(rollouts))
    recut = None
    if writes_every_token(cfg):
        recut = decoded_sequences(runs, rewards, len(rollouts), eos_id=trainer.tokenizer.eos_token_id,
                                  max_new_tokens=cfg.rollout.max_new_tokens)
    if recut is not None:
        return recut, True
    return [RawSequence(list(r.prompt_ids), list(r.response_ids), r.truncated, None if rewards is None else rewards[k])
            for k, r in enumerate(rollouts)], False


def reward_of(raw: RawSequence, rollout: Rollout) -> float:
    """The reference's reward, or the rollout's where the reference has no raw value (offline rollouts)."""
    return raw.reward if raw.reward is not None else float(rollout.reward)


def reference_policy(rollouts: list[Rollout], lengths: list[int], *, fixture: bool,
                     single_turn: bool) -> list[list[bool]]:
    """Per rollout, the policy's tokens over a response of ``lengths[k]`` tokens by the reference's rule: the
    check's multi-turn fixture mask (:func:`tool_masks`) where the check gave one, every token of a single-turn
    sample, else the rollout's own ``response_mask`` (a multi-turn sampler's or offline rollouts')."""
    if fixture:
        masks = tool_masks([r.group for r in rollouts], lengths)
    elif single_turn:
        masks = [None] * len(rollouts)
    else:
        masks = [r.response_mask for r in rollouts]
    return [[True] * n if m is None else [bool(x) for x in m] for m, n in zip(masks, lengths)]


TOOL_VARIANTS = 3
"""Sequence k of a prompt group gets variant (group + k) % 3 of :func:`tool_segments`: none, two inside, cut end."""


def tool_segments(num_response: int, variant: int) -> Optional[list[int]]:
    """A multi-turn response mask of ``num_response`` tokens (1 = the policy's, 0 = a tool's), or None (variant 0,
    or a response under 4 tokens). Variant 1: two tool segments inside, at R//4 (R//8 tokens, at least 1) and R//2
    (R//6, at least 1). Variant 2: one tool token at R//3 and a tool segment cut at the end (the last R//4, at least
    1: trailing zeros). The first token is always the policy's."""
    if variant == 0 or num_response < 4:
        return None
    mask = [1] * num_response
    if variant == 1:
        holes = [(num_response // 4, max(1, num_response // 8)), (num_response // 2, max(1, num_response // 6))]
    else:
        tail = max(1, num_response // 4)
        holes = [(num_response // 3, 1), (num_response - tail, tail)]
    for start, length in holes:
        for j in range(start, min(start + length, num_response)):
            mask[j] = 0
    mask[0] = 1
    return mask


def tool_masks(groups: list[int], lengths: list[int]) -> list[Optional[list[int]]]:
    """:func:`tool_segments` of each sequence (its prompt group and response length, in the rank's order); the same
    sequences get the same mask at any world size (a prompt group never spans ranks)."""
    seen: dict[int, int] = {}
    out = []
    for group, length in zip(groups, lengths):
        k = seen.get(group, 0)
        seen[group] = k + 1
        out.append(tool_segments(length, (group + k) % TOOL_VARIANTS))
    return out


def with_tool_segments(rollouts: list[Rollout]) -> list[Rollout]:
    """The rollouts with :func:`tool_masks`."""
    masks = tool_masks([r.group for r in rollouts], [len(r.response_ids) for r in rollouts])
    return [dataclasses.replace(r, response_mask=m) for r, m in zip(rollouts, masks)]


def reference_counted(policy_masks: list[list[bool]], olds: list, behaviours: list,
                      rejection: Optional[Rejection]) -> list[list[bool]]:
    """The tokens the reference counts: the policy's, less those rejection sampling rejects, from its definition in
    float64 over the policy's tokens: ratio r_t = exp(old_t - behaviour_t) per token, or prod r_t (sequence) or
    (prod r_t)^(1/n) (geometric) for all of them, kept iff low <= r <= high; and by divergence
    (:func:`reference_divergences`), kept iff the statistic <= max. With both, a token must pass both."""
    if rejection is None:
        return [list(m) for m in policy_masks]
    out = []
    for mask, old, behaviour in zip(policy_masks, olds, behaviours):
        log_r = [float(o) - float(b) for o, b, m in zip(old.double().tolist(), behaviour.double().tolist(), mask)
                 if m]
        inside = [True] * len(log_r)
        if rejection.level == "token":
            inside = [rejection.low <= math.exp(x) <= rejection.high for x in log_r]
        elif rejection.level != "none":
            total = sum(log_r) / (len(log_r) if rejection.level == "geometric" and log_r else 1)
            inside = [rejection.low <= math.exp(total) <= rejection.high] * len(log_r)
        if rejection.divergence != "none":
            stats = reference_divergences(log_r, rejection.divergence)
            inside = [i and k <= rejection.divergence_max for i, k in zip(inside, stats)]
        judged = iter(inside)
        out.append([m and next(judged) for m in mask])
    return out


def reference_divergences(log_r: list[float], option: str) -> list[float]:
    """Per policy token of one sequence, the divergence statistic verl's option judges it by, from the definitions
    in float64 (l clamped to +-20): k2 = l^2 / 2, k3 = e^l - 1 - l; token_*: its own; seq_sum_*, seq_mean_*,
    seq_max_*: the sum, mean, max over the sequence, on each of its tokens."""
    clamped = [min(max(x, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP) for x in log_r]
    k = [0.5 * x * x if option.endswith("k2") else math.exp(x) - 1.0 - x for x in clamped]
    if option.startswith("token") or not k:
        return k
    reduce = {"seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}[option.rsplit("_", 1)[0]]
    return [reduce(k)] * len(k)


def with_behaviour(rollouts: list[Rollout], old_R: list[torch.Tensor], *, seed: int) -> list[Rollout]:
    """The rollouts with behaviour log-probs ``old + U(-BEHAVIOUR_SPREAD, +BEHAVIOUR_SPREAD)`` (seeded): a sampler
    that drifted from the trained policy, so the rollout-correction weights differ from 1 and some pass the cap."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rollout, old in zip(rollouts, old_R):
        noise = (torch.rand(old.shape, generator=gen, dtype=torch.float64) * 2 - 1) * BEHAVIOUR_SPREAD
        out.append(dataclasses.replace(rollout, behaviour_logprobs=(old.double() + noise).float().tolist()))
    return out


def without_context_parallel(cfg: DictConfig) -> DictConfig:
    """``cfg`` with parallel.cp=1: the trainer of a check keeps each rank's own rollouts (the batch, the experience
    and the update pass compare ranks against the gathered batch); parallel.cp is checked by its own layout
    (``context parallel cp=C`` in fsdptrain/check/layouts.py), on the same mesh."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plain.parallel.cp = 1
    return plain


def build_session(cfg: DictConfig, info: world.DistInfo, mesh) -> CheckSession:
    """The checked config, the models (as ``fsdptrain train`` builds them) and the batch (collective)."""
    checked, notes = in_checked_precision(check_config(cfg, info.world_size), info.device)
    staleness = separate_staleness(checked)  # None: colocated
    if staleness is not None:  # every launched rank checks as a trainer rank (fsdptrain/check/staleness.py)
        checked = as_colocated(checked)
        notes = notes + ([ON_POLICY_NOTE] if staleness == 0 else [])
    random.seed(checked.trainer.seed)
    torch.manual_seed(checked.trainer.seed)
    start = time.perf_counter()
    trainer = Trainer(without_context_parallel(checked), run_dir=None, info=info, mesh=mesh)
    say(f"check-metrics: models built ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    with checked_precision(checked):
        batch = make_batch(trainer, staleness=staleness or 0)
    say(f"check-metrics: batch generated and its experience made ({time.perf_counter() - start:.1f} s)")
    if checked.drafter.enabled and trainer.auxiliary_loss() is None:  # no vocabulary file or saved drafter yet:
        vocab_size = trainer.models.policy.config.vocab_size  # the batch's ids
        trainer.extensions[0].start(check_vocab(batch.full, vocab_size=vocab_size, on=checked.drafter.on,
                                          draft_vocab_size=draft_vocab_size(checked, vocab_size)))
    return CheckSession(cfg=checked, trainer=trainer, batch=batch,
                        update=update_shape(cfg, checked.rollout.prompts_per_step), notes=notes)
