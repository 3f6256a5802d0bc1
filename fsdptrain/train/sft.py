"""The supervised fine-tuning recipe (``fsdptrain sft``): demonstrations -> mini-batches of the FSDP2 update -> reduce
-> log -> checkpoint (docs/sft.md).

:meth:`FineTuner.run_step` reads top to bottom like `fsdptrain.train.rl.Trainer.run_step`, without rollouts or an
experience pass: the step's rows in a seeded epoch order, this rank's share of each mini-batch, the policy's part's
update of one mini-batch (`fsdptrain.train.trained_part.TrainedPart.update` over
`fsdptrain.train.step.update_on_minibatch`: the agreed pack plan, the global normalisers counted before any forward,
one packed forward per micro-batch, the loss through ``agg_loss``, clip, skip non-finite, step), then the typed
metrics reduced over ranks. It shares with the RL recipe the policy's building (FSDP2/HSDP, LoRA:
`fsdptrain.train.setup.build_policy_model`), the trained part (its optimizer, schedule, guard and watch:
`fsdptrain.train.setup.build_part`) and the run flow (`fsdptrain.run.runner.run_recipe`: resume, the metrics
files, the trackers, the checkpoints and the export).

Ownership and membership are fixed by a row's position ``p`` within the step's ``sft.rows_per_step`` rows: rank
``p % world_size``, mini-batch ``p // (rows_per_step / mini_batches_per_step)``, so a mini-batch holds the same rows
at any world size and the loss is the same number on 1 or N ranks.

Departures from TRL's SFTTrainer: no truncation (a row longer than ``trainer.token_budget`` is an error, never cut),
no padding (sequences are packed, each attending to itself only), and the loss's denominator is the global count
of trained tokens of the whole mini-batch, never a micro-batch's own (docs/loss.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from fsdptrain.data.demonstrations import DemoKeys, Demonstration, load_demonstrations
from fsdptrain.data.packing import pack_sequences
from fsdptrain.data.epoch_order import EpochOrder
from fsdptrain.distributed import world
from fsdptrain.distributed.collectives import plan_agreed, reduce_metrics
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import Max, Metrics, Sum, close_minibatch, finalize, merge_all
from fsdptrain.train.setup import build_part, build_policy_model, moe_aux_coef, resolve_device_type
from fsdptrain.model.loading import build_tokenizer, max_positions
from fsdptrain.run.console import log
from fsdptrain.run.malloc import keep_freed_heap
from fsdptrain.run.perf import StepTimer, phase
from fsdptrain.run.checkpointer import Checkpointed, export_hf_models
from fsdptrain.run.runner import resolve_steps, run_recipe
from fsdptrain.train.pack_losses import DemoTarget, SftLossSettings, packed_sft_loss
from fsdptrain.train.step import MiniBatch
from fsdptrain.train.trained_part import checkpointed_parts


def sft_loss_scale_factor(cfg: DictConfig) -> float:
    """The constant of ``seq-mean-token-sum-norm``: ``loss.loss_scale_factor``, else ``trainer.token_budget`` (the
    longest a demonstration may be)."""
    return float(cfg.loss.loss_scale_factor or cfg.trainer.token_budget)


def demo_keys(cfg: DictConfig) -> DemoKeys:
    return DemoKeys(messages=cfg.sft.messages_key, prompt=cfg.data.prompt_key, completion=cfg.sft.completion_key,
                    tools=cfg.sft.tools_key)


def load_sft_rows(cfg: DictConfig, tokenizer) -> tuple[list[Demonstration], list[Demonstration]]:
    """The training demonstrations (``data.path``) and the held-out ones (``data.eval_path``; none when null)."""
    plain = (lambda v: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v)
    load = dict(tokenizer=tokenizer, keys=demo_keys(cfg), token_budget=cfg.trainer.token_budget,
                max_positions=max_positions(cfg))
    train = load_demonstrations(plain(cfg.data.path), what="data.path", **load)
    evals = ([] if cfg.data.eval_path is None else
             load_demonstrations(plain(cfg.data.eval_path), what="data.eval_path", **load))
    return train, evals


def as_minibatch(rows: Sequence[Demonstration]) -> MiniBatch:
    return MiniBatch([r.prompt_ids for r in rows], [r.response_ids for r in rows],
                     [DemoTarget(torch.tensor(r.response_mask, dtype=torch.bool)) for r in rows])


class FineTuner:
    """Owns the policy's trained part (the model, its optimizer, schedule, guard and watch), the demonstrations' order
    and the run directory of one ``fsdptrain sft`` run; the SFT recipe of the shared run flow
    (`fsdptrain.run.runner.Recipe`)."""

    name = "sft"
    stats = (("sft/loss", "loss", ".4f"), ("sft/grad_norm", "|g|", ".3g"), ("sft/lr", "lr", ".3g"),
             ("perf/step_s", "step", ".2f"), ("eval/loss", "eval", ".4f"))

    def __init__(self, cfg: DictConfig, run_dir: Path, info: world.DistInfo, mesh):
        self.cfg, self.run_dir, self.info, self.mesh = cfg, run_dir, info, mesh
        self.device = info.device
        self.dp_size = world.dp_size(mesh)
        self.tokenizer = build_tokenizer(cfg)
        self.train_rows, self.eval_rows = load_sft_rows(cfg, self.tokenizer)
        self.order = EpochOrder(len(self.train_rows), seed=cfg.data.seed)
        self.num_steps = resolve_steps(cfg, len(self.train_rows), rows_per_step=cfg.sft.rows_per_step)
        policy, self.backend = build_policy_model(cfg, self.tokenizer, mesh, self.device)
        self.part = build_part(cfg, policy, name="policy", prefix="sft/", lr=cfg.trainer.lr,
                               grad_clip=cfg.trainer.grad_clip, loss_fn=packed_sft_loss,
                               settings=SftLossSettings(agg_mode=cfg.loss.agg_mode,
                                                        chunk_size=cfg.loss.logprob_chunk_size),
                               num_steps=self.num_steps, moe_coef=moe_aux_coef(cfg, policy))
        self.kinds: dict[str, str] = {}

    # -- one step ----------------------------------------------------------------------------------------------------

    def run_step(self, step: int) -> dict[str, float]:
        """One optimizer step per mini-batch on every rank; returns the finalised metrics (the same on every rank)."""
        with StepTimer() as timer:
            batches = self.minibatches(self.order.take(self.cfg.sft.rows_per_step))
            with phase("update"):
                loss_metrics, facts = self.update(batches)
            self.part.scheduler.step()
            metrics = merge_all([self.data_metrics(batches), loss_metrics, facts, self.step_facts()])
        evaluation = self.evaluate_if_due(step + 1)
        result = {"step": step, **finalize(merge_all([metrics, evaluation, timer.metrics()]))}
        self.kinds.update((name, metric.kind.value) for group in (metrics, evaluation, timer.metrics())
                          for name, metric in group.items())
        return result

    # -- the step's components ---------------------------------------------------------------------------------------

    def minibatches(self, positions: list[int]) -> list[MiniBatch]:
        """This rank's share of each mini-batch: the step's row ``p`` goes to rank ``p % world_size`` and to
        mini-batch ``p // (rows_per_step / mini_batches_per_step)``."""
        per_mb = len(positions) // self.cfg.trainer.mini_batches_per_step
        rank, size = self.info.rank, self.info.world_size
        return [as_minibatch([self.train_rows[positions[p]] for p in range(start, start + per_mb) if p % size == rank])
                for start in range(0, len(positions), per_mb)]

    def update(self, batches: list[MiniBatch]) -> tuple[Metrics, Metrics]:
        """One optimizer step of the policy's part per mini-batch: the merged loss metrics, and the typed facts of
        the steps (grad norm and global counts: MEANs over the step's optimizer steps)."""
        collected, facts = [], []
        for batch in batches:
            metrics, outcome = self.part.update(batch, dp_size=self.dp_size,
                                                loss_scale_factor=sft_loss_scale_factor(self.cfg),
                                                token_budget=self.cfg.trainer.token_budget, device=self.device)
            collected.append(close_minibatch(self.part.named(metrics)))
            facts.append(self.part.facts(outcome))
        return merge_all(collected), merge_all(facts)

    def data_metrics(self, batches: list[MiniBatch]) -> Metrics:
        """The step's rows and tokens over all ranks: ``batch/num_seqs``, ``batch/num_tokens`` (every token the
        forwards process), ``batch/num_trained_tokens`` (the masks' sum)."""
        return reduce_metrics(Metrics({
            "batch/num_seqs": Sum(sum(b.num_seqs for b in batches)),
            "batch/num_tokens": Sum(sum(sum(b.lengths()) for b in batches)),
            "batch/num_trained_tokens": Sum(sum(sum(b.num_counted_tokens()) for b in batches)),
        }))

    def step_facts(self) -> Metrics:
        """The learning rate after this step's scheduler step and the optimizer steps skipped so far (MAX of a value
        every rank holds)."""
        return Metrics({"sft/lr": Max(self.part.lr), "train/nonfinite_skipped": Max(self.part.guard.num_skipped)})

    def evaluate_if_due(self, done: int) -> Metrics:
        """``eval/loss`` after ``done`` steps when ``trainer.eval_every`` says so (and after the last step)."""
        every = self.cfg.trainer.eval_every
        if not (self.eval_rows and every > 0 and (done % every == 0 or done == self.num_steps)):
            return Metrics()
        return self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> Metrics:
        """``eval/loss``: the negative log-likelihood per trained token over every held-out row (a token-weighted
        MEAN pooled over packs and ranks, whatever ``loss.agg_mode``), and ``eval/num_tokens`` (collective)."""
        rank, size = self.info.rank, self.info.world_size
        batch = as_minibatch([r for i, r in enumerate(self.eval_rows) if i % size == rank])
        norms = LossNormalizers(global_num_tokens=1, global_num_seqs=1)
        collected = []
        for pack in plan_agreed(batch.lengths(), self.cfg.trainer.token_budget).packs:
            packed = pack_sequences(batch.prompts, batch.responses, pack,
                                    response_masks=batch.response_masks()).to(self.device)
            collected.append(packed_sft_loss(self.part.model, packed, [batch.targets[i] for i in pack], norms=norms,
                                             settings=self.part.settings)[1])
        nll = reduce_metrics(merge_all(collected))["nll"]
        return Metrics({"eval/loss": nll, "eval/num_tokens": Sum(nll.count)})

    # -- state -------------------------------------------------------------------------------------------------------

    def checkpointed(self) -> Checkpointed:
        """Every stateful part of the run, by name, for the checkpointer (docs/checkpointing.md)."""
        return checkpointed_parts([self.part], states={"order": self.order})

    def export(self, run_dir: Path) -> None:
        """The final policy as a Hugging Face folder (and a peft adapter under LoRA), collective."""
        export_hf_models(run_dir, policy=self.part.model, critic=None, tokenizer=self.tokenizer,
                         base_path=self.cfg.model.path)

    # -- the run flow's hooks (fsdptrain/run/runner.py) --------------------------------------------------------------

    def prepare_to_load(self, saved_models: list[str]) -> None:
        """Nothing to build: the policy's part is all an SFT checkpoint holds."""

    def report_start(self) -> None:
        cfg = self.cfg
        log(f"fsdptrain sft: {self.info.world_size} rank(s) on {self.device.type}, packed attention: {self.backend}; "
            f"{len(self.train_rows)} demonstrations ({len(self.eval_rows)} held out), {cfg.sft.rows_per_step} per "
            f"step, {self.num_steps} steps, loss.agg_mode={cfg.loss.agg_mode} over each mini-batch's trained tokens "
            "on all ranks")

    def begin(self, start: int) -> None:
        """Nothing before the first step (``eval/loss`` is logged after steps only)."""

    def after_step(self, step: int, result: dict[str, float], *, first: bool, console) -> None:
        """Nothing beyond the metrics line."""

    def summarize(self, history: list[dict[str, float]]) -> None:
        first, last = history[0], history[-1]
        log(f"sft: loss {first['sft/loss']:.4f} at step {first['step']} -> {last['sft/loss']:.4f} at step "
            f"{last['step']}" + (f", eval/loss {last['eval/loss']:.4f}" if "eval/loss" in last else ""))

    def close(self) -> None:
        """Nothing to release."""


# ---- the run --------------------------------------------------------------------------------------------------------


def build_fine_tuner(cfg: DictConfig, run_dir: Path, info: world.DistInfo, mesh) -> FineTuner:
    tuner = FineTuner(cfg, run_dir, info, mesh)
    keep_freed_heap()  # after loading (its transient copies go back): each step reuses the last one's pages
    return tuner


def sft(cfg: DictConfig, run_dir: str) -> int:
    """The ``fsdptrain sft`` job on this rank (the shared run flow over :class:`FineTuner`); returns the exit code."""
    return run_recipe(cfg, run_dir, build_fine_tuner, device_type=resolve_device_type(cfg))
