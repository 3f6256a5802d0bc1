"""Generation's set-up and seeds, shared by every source that samples: the :func:`generation` block (timed, sdpa,
weights gathered once, layers eager), the per-rank sampling seed and the evaluation samples' seeds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fsdptrain.distributed.gather import gathered_weights, should_gather
from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.train.build import DTYPES
from fsdptrain.train.perf import phase


@contextlib.contextmanager
def generation(model, cfg, device: torch.device, *, always_gather: bool = False) -> Iterator[None]:
    """The block generates with ``model``: the ``generate`` phase, sdpa attention, the policy's weights gathered once
    for the whole block when ``rollout.gather_weights`` (or ``always_gather``) says so (collective: every rank enters
    it), and compiled layers run eagerly (``parallel.compile`` is for the training forwards; a KV cache would
    recompile every token)."""
    with phase("generate"):
        mode = "always" if always_gather else cfg.rollout.gather_weights
        gather = should_gather(model, mode=mode, max_share=cfg.rollout.gather_weights_max_share,
                               param_dtype=DTYPES[cfg.parallel.param_dtype], device=device)
        with generation_attention(model), gathered_weights(
                model, enabled=gather, reshard_after_forward=cfg.parallel.reshard_after_forward), \
                torch.compiler.set_stance("force_eager"):
            yield



NUM_SAMPLES_SHOWN = 4
"""Samples of rank 0 kept for samples.jsonl and the first step's printout."""


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """A rank's sampling seed for a step: reproducible across runs and resumes, different across ranks."""
    return (seed * 1_000_003 + step * 1_009 + rank) % (2**31)


def eval_sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of evaluation sample ``sample`` of evaluation prompt ``prompt`` after ``step`` steps: a function of
    these four only (never of the rank or the world size), so the samples are the same at any world size."""
    return ((((seed * 1_000_003 + step) * 1_000_033 + prompt) * 1_009 + sample) * 7_919 + 1) % (2**62)
