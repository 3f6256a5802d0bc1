"""Build the bundled word-level tokenizer offline with the `tokenizers` library (no download).

Run from the repository root: `python scripts/make_tokenizer.py` writes fsdptrain/assets/tokenizer/tokenizer.json.
The vocabulary: four special tokens, the ten digits, the task verbs and a few symbols, split on
whitespace, so every bundled task's text round-trips exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdptrain.data.tokenizer import TOKENIZER_PATH, build_tokenizer  # noqa: E402

if __name__ == "__main__":
    TOKENIZER_PATH.parent.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(TOKENIZER_PATH))
    print(f"wrote {TOKENIZER_PATH}")
