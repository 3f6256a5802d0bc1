"""Routing replay's config rules (``model.moe.routing_replay``, docs/moe.md "Routing replay"), registered in
:mod:`fsdptrain.config.validate` with one line. Torch-free, like the rest of the validation. Each refusal is a
setting whose rollouts carry no routes, or whose forward would not replay them exactly."""

from __future__ import annotations

from omegaconf import DictConfig

from fsdptrain.registry.errors import ConfigError


def check_routing_replay(cfg: DictConfig) -> None:
    """Refuse what routing replay cannot do, one line each: the setting, why, and the fix."""
    if not cfg.model.moe.routing_replay:
        return
    r = cfg.rollout
    refused = (
        (cfg.data.source in ("jsonl", "sft"), f"data.source={cfg.data.source}",
         "its sequences were not generated here, so they carry no routes"),
        (r.agent is not None, "rollout.agent", "the agent endpoint's rollouts carry no routes"),
        (r.engine == "generate" and (bool(r.tools) or r.environment is not None),
         "rollout.engine=generate with tools", "it re-prefills each turn's whole context, whose routes may differ "
         "from those the earlier turns sampled with; use rollout.engine=continuous"),
        (cfg.trainer.share_prompts == "true", "trainer.share_prompts=true",
         "a group's prompt is held once, but each sample routed its prompt's last token on its own"),
        (cfg.drafter.enabled, "drafter.enabled=true", "the drafter's policy forward does not replay"),
    )
    for bad, setting, why in refused:
        if bad:
            raise ConfigError(f"model.moe.routing_replay=true is not supported with {setting} ({why}): set "
                              "model.moe.routing_replay=false or change that setting (docs/moe.md)")
