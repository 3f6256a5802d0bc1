"""The co-trained drafter's life in a run: its vocabulary, its sharded build, its optimizer, its export.

Every rank runs these collectively, in the same order. :class:`DrafterExtension` plugs all of it into the train
step through the extension hook (`fsdptrain.train.rl.Extension`, docs/architecture.md "Extensions"). The drafter
is built once its draft vocabulary is known: at start from `drafter.vocab_path`, or from the token counts of the
first `drafter.vocab_from_steps` steps' rollouts (summed over ranks, so every rank builds the same vocabulary), right
before that last step's update. Its random initialisation draws from a generator of its own (seeded from
`trainer.seed`), so turning the drafter on leaves the global RNG, and hence the rollouts and the policy's run,
unchanged. docs/drafter.md describes the whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig

from fsdptrain.config import ConfigError
from fsdptrain.data.rollout_record import Rollout
from fsdptrain.distributed import world
from fsdptrain.distributed.fsdp import gather_full_state_dict, gather_rows, shard_as_one_unit
from fsdptrain.model.loading import decoder_layers
from fsdptrain.model.drafter import (
    DraftVocab,
    Eagle3Drafter,
    default_feature_layers,
    draft_config,
    draft_vocab_from_counts,
    load_draft_vocab,
)
from fsdptrain.model.drafter_export import export_drafter, load_drafter
from fsdptrain.metrics.typed import Max, Metrics
from fsdptrain.train.cotrain import DraftLossSettings, DrafterUpdate
from fsdptrain.train.optim import NonFiniteGuard, build_optimizer, build_scheduler
from fsdptrain.train.setup import DTYPES
from fsdptrain.run.checkpointer import guard_of_layout_1

DEFAULT_DRAFT_VOCAB = 32000
DRAFTER_SEED_OFFSET = 7919
"""The drafter's init seed is trainer.seed + this (any fixed offset: the policy's seeds are trainer.seed and +1)."""


MIN_DEFAULT_LR = 1.0e-4
"""EAGLE-3's usual drafter learning rate on a frozen target: the floor of the default `drafter.lr`."""


def drafter_lr(cfg: DictConfig) -> float:
    """`drafter.lr`, or when null max(1e-4, trainer.lr): a co-trained drafter's teacher moves at the policy's rate,
    so the drafter must adapt at least as fast (docs/drafter.md, "Learning rate", has the measurements)."""
    if cfg.drafter.lr is not None:
        return cfg.drafter.lr
    return max(MIN_DEFAULT_LR, cfg.trainer.lr)


def draft_vocab_size(cfg: DictConfig, vocab_size: int) -> int:
    """`drafter.draft_vocab_size`, or min(32000, V) when null; a size above the policy's vocabulary is an error."""
    size = cfg.drafter.draft_vocab_size
    if size is None:
        return min(DEFAULT_DRAFT_VOCAB, vocab_size)
    if size > vocab_size:
        raise ConfigError(f"drafter.draft_vocab_size={size} is larger than the policy's vocabulary of {vocab_size} "
                          f"tokens: choose at most {vocab_size} (or null)")
    return size


def local_token_counts(rollouts: list[Rollout], vocab_size: int, *, on: str) -> torch.Tensor:
    """float64 `[V]`: how often each id is a token the drafter would predict (the policy's response tokens, by the
    rollout's `response_mask`, or every token with `on=all`) in this rank's rollouts."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in rollouts:
        policy = (list(r.response_ids) if r.response_mask is None else
                  [t for t, m in zip(r.response_ids, r.response_mask) if m])
        ids = policy if on == "response" else list(r.prompt_ids) + list(r.response_ids)
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size).to(torch.float64)
    return counts


def vocab_from_file(cfg: DictConfig, vocab_size: int) -> DraftVocab:
    vocab = load_draft_vocab(cfg.drafter.vocab_path, vocab_size=vocab_size)
    if vocab.size != draft_vocab_size(cfg, vocab_size) and cfg.drafter.draft_vocab_size is not None:
        raise ConfigError(f"{cfg.drafter.vocab_path} holds {vocab.size} tokens but drafter.draft_vocab_size="
                          f"{cfg.drafter.draft_vocab_size}: set drafter.draft_vocab_size=null or {vocab.size}")
    return vocab


def placeholder_vocab(cfg: DictConfig, vocab_size: int) -> DraftVocab:
    """The first D ids: a drafter of the right shapes whose d2t/t2d a checkpoint then overwrites."""
    return DraftVocab.from_target_ids(range(draft_vocab_size(cfg, vocab_size)), vocab_size)


def plain_drafter(policy, vocab: DraftVocab, *, feature_layers, init_head_from_policy: bool, seed: int,
                  num_layers: int = 1) -> Eagle3Drafter:
    """The full drafter on the CPU, the same on every rank (collective when the head is copied from a sharded
    policy)."""
    policy_layers = len(decoder_layers(policy))
    layers = tuple(feature_layers) if feature_layers is not None else default_feature_layers(policy_layers)
    if any(not 0 <= i < policy_layers for i in layers):
        raise ConfigError(f"drafter.feature_layers={list(layers)} must lie in [0, {policy_layers}) for this policy "
                          f"of {policy_layers} decoder layers")
    config = draft_config(policy.config, draft_vocab_size=vocab.size, num_layers=num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(config, vocab, layers)
    if init_head_from_policy:
        rows = gather_rows(policy.get_output_embeddings().weight, vocab.draft_to_target)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(rows.to(device="cpu", dtype=drafter.lm_head.weight.dtype))
    return drafter


def _mismatch(path: str, what: str, saved, wanted, fix: str) -> ConfigError:
    return ConfigError(f"drafter.path={path} holds a drafter with {what} {saved}, but {fix} is {wanted}: "
                       f"use a drafter saved for this policy and settings (or drop drafter.path)")


def saved_drafter(cfg: DictConfig, policy) -> Eagle3Drafter:
    """The drafter saved at `drafter.path` (an `export/drafter/` folder: config.json, d2t/t2d and the weights), in
    float32, checked against the policy (hidden size, vocabulary, feature layers) and against the drafter settings
    that name a shape (`num_layers`, and `feature_layers`, `draft_vocab_size` where set): a mismatch is a
    ConfigError."""
    d, path = cfg.drafter, cfg.drafter.path
    try:
        drafter = load_drafter(path)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"drafter.path={path} is not a drafter folder written by export/drafter/ ({first})")
    config, target = drafter.config, policy.config
    policy_layers = len(decoder_layers(policy))
    if config.target_hidden_size != target.hidden_size or config.hidden_size != target.hidden_size:
        raise _mismatch(path, "hidden size", config.target_hidden_size, target.hidden_size, "the policy's")
    if config.vocab_size != target.vocab_size:
        raise _mismatch(path, "a target vocabulary of", config.vocab_size, target.vocab_size, "the policy's")
    if any(not 0 <= i < policy_layers for i in drafter.feature_layers):
        raise _mismatch(path, "feature layers", list(drafter.feature_layers), f"[0, {policy_layers})",
                        "the policy's layer range")
    if config.num_hidden_layers != d.num_layers:
        raise _mismatch(path, "num_hidden_layers", config.num_hidden_layers, d.num_layers, "drafter.num_layers")
    if d.feature_layers is not None and list(d.feature_layers) != list(drafter.feature_layers):
        raise _mismatch(path, "feature layers", list(drafter.feature_layers), list(d.feature_layers),
                        "drafter.feature_layers")
    if d.draft_vocab_size is not None and d.draft_vocab_size != config.draft_vocab_size:
        raise _mismatch(path, "draft_vocab_size", config.draft_vocab_size, d.draft_vocab_size,
                        "drafter.draft_vocab_size")
    return drafter.float()


def build_drafter(cfg: DictConfig, policy, vocab: Optional[DraftVocab], *, mesh, device: torch.device, backend: str,
                  num_steps: int) -> tuple[DrafterUpdate, object]:
    """The sharded drafter (a new one over `vocab`, or with `vocab` None the saved one at `drafter.path`), its AdamW
    (drafter.lr, trainer's betas and eps) and scheduler (the policy's schedule over the run's `num_steps`)."""
    d, t = cfg.drafter, cfg.trainer
    if vocab is None:
        drafter = saved_drafter(cfg, policy)
    else:
        drafter = plain_drafter(policy, vocab, feature_layers=d.feature_layers, num_layers=d.num_layers,
                                init_head_from_policy=d.init_head_from_policy, seed=t.seed + DRAFTER_SEED_OFFSET)
    shard_as_one_unit(drafter, mesh=mesh, param_dtype=DTYPES[cfg.parallel.param_dtype],
                      reduce_dtype=DTYPES[cfg.parallel.reduce_dtype], device=device)
    optimizer = build_optimizer(drafter, lr=drafter_lr(cfg), betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                weight_decay=d.weight_decay)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, total_steps=num_steps,
                                schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio)
    update = DrafterUpdate(module=drafter, optimizer=optimizer, grad_clip=d.grad_clip,
                           guard=NonFiniteGuard(t.max_nonfinite_in_a_row),
                           loss=DraftLossSettings(on=d.on, loss_weight=d.loss_weight, backend=backend),
                           refresh_passes=d.refresh_passes)
    return update, scheduler


def export_sharded_drafter(drafter: Eagle3Drafter, out_dir: Path, target_config, *, dtype: str,
                           embed_tokens: Optional[torch.Tensor] = None) -> None:
    """`export_drafter` of the gathered drafter, written by rank 0 (collective)."""
    state = gather_full_state_dict(drafter)
    if world.rank() == 0:
        plain = Eagle3Drafter(drafter.config, DraftVocab(d2t=state["d2t"], t2d=state["t2d"]), drafter.feature_layers)
        plain.load_state_dict(state, strict=True)
        export_drafter(plain, out_dir, target_config, dtype=DTYPES[dtype], embed_tokens=embed_tokens)
    world.barrier()


class DrafterExtension:
    """The co-trained drafter as an extension of the train step (`fsdptrain.train.rl.Extension`): it counts the
    draft vocabulary over the first steps' rollouts, then trains as the policy's auxiliary loss (`DrafterUpdate`),
    saves and restores itself with the checkpoint, logs `drafter/lr` and `drafter/nonfinite_skipped`, and exports
    `export/drafter/`."""

    name = "drafter"

    def __init__(self, cfg: DictConfig, policy, *, mesh, device: torch.device, backend: str, num_steps: int):
        self.cfg, self.policy = cfg, policy
        self.build_args = dict(mesh=mesh, device=device, backend=backend, num_steps=num_steps)
        self.update: Optional[DrafterUpdate] = None
        self.scheduler = None
        self.draft_counts: Optional[torch.Tensor] = None
        """Token counts (summed over ranks) of the steps so far, while the draft vocabulary is being counted."""
        vocab_size = policy.config.vocab_size
        draft_vocab_size(cfg, vocab_size)  # a size above the vocabulary fails before the first step
        if cfg.drafter.path is not None:  # the saved drafter, its vocabulary with it
            self.start(None)
        elif cfg.drafter.vocab_path is not None:
            self.start(vocab_from_file(cfg, vocab_size))

    def start(self, vocab: Optional[DraftVocab]) -> None:
        """Build the sharded drafter, its optimizer and scheduler over `vocab`, or from `drafter.path` when None
        (collective)."""
        self.update, self.scheduler = build_drafter(self.cfg, self.policy, vocab, **self.build_args)

    def on_rollouts(self, step: int, rollouts: list[Rollout]) -> None:
        """While the vocabulary is being counted: add this step's token counts (summed over ranks); after
        `drafter.vocab_from_steps` steps, build the drafter over the most frequent tokens (collective)."""
        if self.update is not None:
            return
        vocab_size = self.policy.config.vocab_size
        counts = world.all_reduce_sum(local_token_counts(rollouts, vocab_size, on=self.cfg.drafter.on))
        self.draft_counts = counts if self.draft_counts is None else self.draft_counts + counts
        if step + 1 >= self.cfg.drafter.vocab_from_steps:
            size = draft_vocab_size(self.cfg, vocab_size)
            self.start(draft_vocab_from_counts(self.draft_counts, draft_vocab_size=size))
            self.draft_counts = None

    def auxiliary_loss(self) -> Optional[DrafterUpdate]:
        return self.update

    def extra_policy_forwards(self, epochs: int) -> int:
        """The refresh passes' policy forwards of one step (counted in perf/*; the drafter's own FLOPs are not)."""
        return epochs * self.update.refresh_passes if self.update is not None else 0

    def parts(self) -> tuple[dict, dict, dict]:
        """(models, optimizers, schedulers) to checkpoint: the drafter's weights with d2t/t2d, AdamW and schedule."""
        if self.update is None:
            return {}, {}, {}
        return {"drafter": self.update.module}, {"drafter": self.update.optimizer}, {"drafter": self.scheduler}

    def prepare_to_load(self, saved_models: list[str]) -> None:
        """A checkpoint with a drafter while this run has none yet: build one of the right shapes, whose weights and
        d2t/t2d the checkpoint then overwrites (collective)."""
        if "drafter" in saved_models and self.update is None:
            self.start(placeholder_vocab(self.cfg, self.policy.config.vocab_size))

    def state_dict(self) -> dict:
        guard = self.update.guard.state_dict() if self.update is not None else None
        return {"guard": guard, "draft_counts": None if self.draft_counts is None else self.draft_counts.clone()}

    def load_state_dict(self, state: dict) -> None:
        if self.update is not None and state["guard"] is not None:
            self.update.guard.load_state_dict(state["guard"])
        self.draft_counts = state["draft_counts"]

    @staticmethod
    def state_of_layout_1(extra: dict) -> dict:
        """The state of a layout-1 checkpoint (docs/checkpointing.md): the guard's ``drafter_nonfinite`` pair and
        the vocabulary's ``draft_counts``, both in its ``extra``."""
        return {"guard": guard_of_layout_1(extra.get("drafter_nonfinite")), "draft_counts": extra.get("draft_counts")}

    def step_facts(self) -> Metrics:
        """`drafter/lr` and `drafter/nonfinite_skipped` (a run total): the same on every rank, MAX over ranks."""
        if self.update is None:
            return Metrics()
        return Metrics({"drafter/lr": Max(self.update.optimizer.param_groups[0]["lr"]),
                        "drafter/nonfinite_skipped": Max(self.update.guard.num_skipped)})

    def export(self, run_dir: Path) -> None:
        if self.update is not None:
            export_sharded_drafter(self.update.module, run_dir / "export" / "drafter", self.policy.config,
                                   dtype=self.cfg.drafter.export_dtype)
