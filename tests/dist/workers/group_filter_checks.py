"""Dynamic sampling on 2 ranks: each rank generates the groups it owns, round by round, and filter_groups agrees on
when to stop (all-reduce), then deals the kept groups out under the new numbering (all-gather). Writes this rank's
rollouts (prompt_ids naming round, group, sample; the new group), its finalized metrics and the rounds it was asked
for. The scenario is tests/unit/test_group_filter.py's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdptrain.distributed import world
from tests.dist.workers.report import report_and_exit
from tests.unit.test_group_filter import run

CASES = {"refill": dict(target_groups=3, max_rounds=3), "max_rounds": dict(target_groups=8, max_rounds=2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    info = world.init_distributed(device_type="cpu")
    record = {}
    for name, case in CASES.items():
        mine, metrics, asked = run(**case, rank=info.rank, world_size=info.world_size)
        record[name] = {"rollouts": [[r.prompt_ids, r.group] for r in mine], "metrics": metrics, "asked": asked}
    report_and_exit(args.out, info.rank, record, 0)


if __name__ == "__main__":
    main()
