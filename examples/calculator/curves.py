"""Print a calculator run's curves: per step the share of samples that called the tool and the mean reward, then
both averaged over the first and the last five steps.

    python examples/calculator/curves.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curves(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, tools/call_frequency (0 when no tool is configured), reward/mean) per line of metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r.get("tools/call_frequency", 0.0), r["reward/mean"]) for r in rows]


def main() -> None:
    for run_dir in map(Path, sys.argv[1:]):
        points = curves(run_dir)
        print(f"{run_dir}")
        print("  step  call_frequency  reward")
        for step, calls, reward in points:
            print(f"  {step:4d}  {calls:14.3f}  {reward:6.3f}")
        for name, part in (("first 5", points[:5]), ("last 5", points[-5:])):
            calls, rewards = [p[1] for p in part], [p[2] for p in part]
            print(f"  {name}: call_frequency {sum(calls) / len(calls):.3f}, reward {sum(rewards) / len(rewards):.3f}")


if __name__ == "__main__":
    main()
