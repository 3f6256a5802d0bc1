"""Writes prompts.jsonl: row i is task i of arith.py's taskset (fsdptrain.rollout.verifiers_agent.taskset_rows)."""

import json
from pathlib import Path

import verifiers.v1 as vf
from arith import SumTaskset

from fsdptrain.rollout.verifiers_agent import taskset_rows

if __name__ == "__main__":
    rows = taskset_rows(SumTaskset(vf.TasksetConfig()))
    (Path(__file__).parent / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
