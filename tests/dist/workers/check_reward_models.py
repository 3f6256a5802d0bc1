"""Worker: ``fsdptrain check-reward``'s job (`fsdptrain.train.check_reward.check_reward`) on this rank, and what the
process holds while the policy generates: a global forward pre-hook (torch's own, on every module), at its first
call, collects the garbage and counts the live Hugging Face models by class and the live optimizers. Writes
<out>/rank<r>.json: ``{"code": exit code, "models": {class name: count}, "optimizers": count}``.
"""

from __future__ import annotations

import gc
from collections import Counter

import torch
from transformers import PreTrainedModel

from fsdptrain.config.compose import compose_config
from fsdptrain.train.check_reward import check_reward
from tests.dist.workers.report import dist_worker, option


@dist_worker(option("--overrides", nargs="*", default=[]))
def main(args, info, record: dict) -> None:
    seen: dict = {}

    def count_live(module, inputs):
        if seen:
            return
        gc.collect()
        live = [o for o in gc.get_objects() if isinstance(o, (PreTrainedModel, torch.optim.Optimizer))]
        # the heads' classes (FSDP2 renames a sharded model's class FSDP<name>); the inner decoders are left out
        seen["models"] = dict(Counter(type(o).__name__.removeprefix("FSDP") for o in live
                                      if isinstance(o, PreTrainedModel) and "For" in type(o).__name__))
        seen["optimizers"] = sum(isinstance(o, torch.optim.Optimizer) for o in live)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count_live)
    try:
        record["code"] = check_reward(compose_config(list(args.overrides)))
    finally:
        handle.remove()
    record.update(seen)


if __name__ == "__main__":
    main()
