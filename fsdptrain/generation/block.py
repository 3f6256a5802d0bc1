"""The generation block every decoder runs in (:func:`generation`): the ``generate`` phase timed, sdpa attention,
the policy's weights gathered once for the block, compiled layers run eagerly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fsdptrain.config import ConfigError, multi_turn
from fsdptrain.distributed import world
from fsdptrain.distributed.expert_parallel import experts_gathered
from fsdptrain.generation.gather import (
    free_memory_bytes,
    fsdp_units,
    gathered_weights,
    should_gather,
    unsharded_bytes,
)
from fsdptrain.model.attention_switch import generation_attention
from fsdptrain.model.loading import DTYPES
from fsdptrain.run.perf import phase


@contextlib.contextmanager
def generation(model, cfg, device: torch.device, *, always_gather: bool = False) -> Iterator[None]:
    """The block generates with ``model``: the ``generate`` phase, sdpa attention, the policy's weights gathered once
    for the whole block when ``rollout.gather_weights`` says so (collective: every rank enters it), the experts of an
    expert-parallel policy gathered whole always (fsdptrain/distributed/expert_parallel.py), and compiled
    layers run eagerly (``parallel.compile`` is for the training forwards; a KV cache would recompile every token).

    ``always_gather``: the block's ranks run their own numbers of forwards (the continuous engine; multi-turn), so on
    more than one rank the policy must be gathered: a sharded forward all-gathers, and ranks out of step would wait
    on each other forever. ``rollout.gather_weights=never``, or ``auto`` finding the unsharded policy too large for
    its share of free memory, is then a ConfigError naming the way out (:func:`gather_for_own_forwards`). On one
    rank nothing can fall out of step, and ``rollout.gather_weights`` decides as it does for ``generate``."""
    with phase("generate"):
        settings = dict(max_share=cfg.rollout.gather_weights_max_share, param_dtype=DTYPES[cfg.parallel.param_dtype],
                        device=device)
        if always_gather and world.world_size() > 1:
            gather = gather_for_own_forwards(model, cfg, **settings)
        else:
            gather = should_gather(model, mode=cfg.rollout.gather_weights, **settings)
        # experts whole under expert parallelism, whatever gather says: each rank decodes its own number of tokens
        resharding = cfg.parallel.reshard_after_forward
        with generation_attention(model), gathered_weights(model, enabled=gather, reshard_after_forward=resharding), \
                experts_gathered(model, reshard_after_forward=resharding), torch.compiler.set_stance("force_eager"):
            yield


def gather_for_own_forwards(model, cfg, *, max_share: float, param_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether to gather a block whose ranks run their own numbers of forwards, on several ranks (collective): True
    when the model is sharded at all and ``rollout.gather_weights`` allows it (``always``, or ``auto`` finding room);
    a ConfigError where it does not (the block cannot run sharded)."""
    mode = cfg.rollout.gather_weights
    if not fsdp_units(model):
        return False
    if mode != "never" and should_gather(model, mode=mode, max_share=max_share, param_dtype=param_dtype,
                                         device=device):
        return True
    why = ("rollout.gather_weights=never" if mode == "never" else
           f"the unsharded policy ({unsharded_bytes(model, param_dtype) / 2**30:.2f} GiB) is more than "
           f"rollout.gather_weights_max_share={max_share} of this rank's free memory "
           f"({free_memory_bytes(device) / 2**30:.2f} GiB)")
    if multi_turn(cfg):
        what, outs = "multi-turn generation (rollout.tools or rollout.environment)", "set "
    else:
        what, outs = "rollout.engine=continuous", "set rollout.engine=generate (it generates sharded), or "
    raise ConfigError(f"{what} runs each rank's own number of forwards, which needs the policy gathered on every "
                      f"rank, but {why}: {outs}rollout.gather_weights=always, or raise "
                      f"rollout.gather_weights_max_share (docs/rollout.md)")
