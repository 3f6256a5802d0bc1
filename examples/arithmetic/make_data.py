"""Write train.jsonl (2000 rows) and eval.jsonl (100 rows): one-digit sums and differences, e.g. "3 + 4 =" -> "7".

Every prompt and answer uses only words of fsdptrain's bundled tokenizer (the digits, "+", "-" and "="), and every
answer is one digit (a + b <= 9, a - b >= 0), so a tiny model trained from scratch can learn the table. There are 110
distinct problems; eval.jsonl samples the same table with another seed (it measures learning the table, not
generalising to unseen sums).

    python examples/arithmetic/make_data.py [--out-dir examples/arithmetic]
"""

import argparse
import json
import random
from pathlib import Path

PROBLEMS = [(f"{a} + {b} =", a + b) for a in range(10) for b in range(10) if a + b <= 9] + [
    (f"{a} - {b} =", a - b) for a in range(10) for b in range(a + 1)]


def rows(num_rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": prompt, "answer": str(answer)} for prompt, answer in (rng.choice(PROBLEMS)
                                                                              for _ in range(num_rows))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent))
    out = Path(parser.parse_args().out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, num_rows, seed in (("train.jsonl", 2000, 0), ("eval.jsonl", 100, 1)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows(num_rows, seed)))
        print(f"wrote {out / name} ({num_rows} rows)")


if __name__ == "__main__":
    main()
