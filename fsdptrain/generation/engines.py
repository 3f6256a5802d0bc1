"""The decoder a run uses, chosen once from ``rollout.engine`` (docs/rollout.md)."""

from __future__ import annotations

from fsdptrain.generation.continuous import ContinuousDecoder
from fsdptrain.generation.decoder import Decoder
from fsdptrain.generation.generate import GenerateDecoder

ENGINES = {"continuous": ContinuousDecoder, "generate": GenerateDecoder}


def make_decoder(cfg, model, tokenizer, device) -> Decoder:
    """The decoder ``rollout.engine`` names, over ``model`` (the policy) and its tokenizer."""
    return ENGINES[cfg.rollout.engine](cfg, model, tokenizer, device)
