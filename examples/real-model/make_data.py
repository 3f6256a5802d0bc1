"""Write train.jsonl (2000 rows) and eval.jsonl (32 rows): two-digit additions as chat prompts for a chat model.

    {"prompt": [{"role": "user", "content": "What is 23 + 45? Answer with the number only."}], "answer": "68"}

Both addends are between 10 and 99 (8,100 problems). The 32 evaluation problems are drawn first, with their own seed,
and never appear in train.jsonl: the greedy evaluation measures held-out sums, not recall of the training rows.

    python examples/real-model/make_data.py [--out-dir examples/real-model]
"""

import argparse
import json
import random
from pathlib import Path

PROBLEMS = [(a, b) for a in range(10, 100) for b in range(10, 100)]
NUM_TRAIN, NUM_EVAL = 2000, 32
INSTRUCTION = "Answer with the number only."
"""Without it the untrained model explains instead of answering within 16 tokens (greedy held-out accuracy 0.00 vs
0.16 with it, examples/real-model/README.md)."""


def row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}], "answer": str(a + b)}


def splits() -> tuple[list[dict], list[dict]]:
    held_out = random.Random(1).sample(PROBLEMS, NUM_EVAL)
    rest = sorted(set(PROBLEMS) - set(held_out))
    rng = random.Random(0)
    return [row(*rng.choice(rest)) for _ in range(NUM_TRAIN)], [row(a, b) for a, b in held_out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent))
    out = Path(parser.parse_args().out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("train.jsonl", "eval.jsonl"), splits()):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / name} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
