"""Dynamic sampling on 2 ranks: each rank generates the groups it owns, round by round, and filter_groups agrees on
when to stop (all-reduce), then deals the kept groups out under the new numbering (all-gather). Writes this rank's
rollouts (prompt_ids naming round, group, sample; the new group), its finalized metrics and the rounds it was asked
for. The scenario is tests/unit/test_group_filter.py's.
"""

from __future__ import annotations


from tests.dist.workers.report import dist_worker
from tests.unit.test_group_filter import run

CASES = {"refill": dict(target_groups=3, max_rounds=3), "max_rounds": dict(target_groups=8, max_rounds=2)}


@dist_worker()
def main(args, info, record: dict) -> None:
    for name, case in CASES.items():
        mine, metrics, asked = run(**case, rank=info.rank, world_size=info.world_size)
        record[name] = {"rollouts": [[r.prompt_ids, r.group] for r in mine], "metrics": metrics, "asked": asked}


if __name__ == "__main__":
    main()
