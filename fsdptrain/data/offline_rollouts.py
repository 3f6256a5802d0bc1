"""Offline rollouts read from JSONL.

Everything is stored and rewarded as text, so any tokenizer works. Prompt groups carry a global index: mini-batch
membership and the rank that owns a group follow from it, never from the world size.

Offline JSONL rows: ``{"prompt": str, "response": str, "reward": float}`` and optionally ``"group"`` (any JSON
scalar; rows sharing it are samples of one prompt), ``"truncated"`` (bool; otherwise EOS is appended to the response)
``"behaviour_logprobs"`` (one float per response token, EOS included; then used as the old log-probs) and
``"response_mask"`` (one 0 or 1 per response token, EOS included: 1 where the policy wrote the token, 0 where a
tool, the environment or a chat separator did, as a multi-turn rollout's mask; at least one 1; absent: all ones).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from fsdptrain.config import ConfigError
from fsdptrain.data.rollout_record import Rollout


class DataError(ConfigError):
    """A bad input file: the message names the file and line; the CLI prints it and exits 2."""


def _row_error(path: Path, line_no: int, message: str) -> DataError:
    return DataError(f"{path}:{line_no}: {message}")


def _parse_row(row: object, path: Path, line_no: int) -> dict:
    if not isinstance(row, dict):
        raise _row_error(path, line_no, "expected a JSON object with prompt, response and reward")
    for key, kind in (("prompt", str), ("response", str)):
        if not isinstance(row.get(key), kind):
            raise _row_error(path, line_no, f"'{key}' must be a string")
    reward = row.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise _row_error(path, line_no, f"'reward' must be a finite number, got {reward!r}")
    if "truncated" in row and not isinstance(row["truncated"], bool):
        raise _row_error(path, line_no, f"'truncated' must be a JSON boolean (true or false), got {row['truncated']!r}")
    logprobs = row.get("behaviour_logprobs")
    if logprobs is not None and not (
        isinstance(logprobs, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs)
    ):
        raise _row_error(path, line_no, "'behaviour_logprobs' must be a list of numbers")
    bad = [x for x in logprobs or [] if not (math.isfinite(x) and x <= 0)]
    if bad:
        raise _row_error(path, line_no, f"'behaviour_logprobs' must be finite log-probabilities <= 0, got {bad[0]!r}")
    mask = row.get("response_mask")
    if mask is not None and not (isinstance(mask, list) and all(type(x) is int and x in (0, 1) for x in mask)):
        raise _row_error(path, line_no, f"'response_mask' must be a list of 0s and 1s, got {_brief(mask)}")
    if mask is not None and 1 not in mask:
        raise _row_error(path, line_no, "'response_mask' has no 1: the row holds no token of the policy")
    return row


def _brief(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def load_jsonl_rollouts(
    path: str, tokenizer, *, max_response_length: int, skip_bad_rows: bool
) -> tuple[list[Rollout], int]:
    """Read offline rollouts; return them with their group indices assigned, and the number of skipped rows.

    A malformed row raises :class:`DataError` naming ``file:line`` unless ``skip_bad_rows``, in which case it is
    counted and skipped. A response longer than ``max_response_length`` tokens is a bad row too.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data.path={path!r}: no such file")
    rollouts: list[Rollout] = []
    group_index: dict[object, int] = {}
    skipped = 0
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data.path={path!r} is not UTF-8 text (near byte offset {err.start}): "
                        f"save it as UTF-8") from None
    if "\0" in text:
        raise DataError(f"data.path={path!r} is a binary file (it holds NUL bytes), not JSONL text")
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            try:
                row = _parse_row(json.loads(line), file, line_no)
            except json.JSONDecodeError as err:
                raise _row_error(file, line_no, f"invalid JSON ({err.msg})") from None
            rollouts.append(_tokenize_row(row, tokenizer, file, line_no, max_response_length, group_index))
        except DataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    if not rollouts:
        raise DataError(f"{file}: no usable rows")
    return rollouts, skipped


def _tokenize_row(row: dict, tokenizer, file: Path, line_no: int, max_response_length: int,
                  group_index: dict[object, int]) -> Rollout:
    prompt_ids = tokenizer(row["prompt"])["input_ids"]
    response_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
    truncated = row.get("truncated", False)
    if not truncated:
        response_ids = response_ids + [tokenizer.eos_token_id]
    if not response_ids or not prompt_ids:
        raise _row_error(file, line_no, "empty prompt or response")
    if len(response_ids) > max_response_length:
        raise _row_error(file, line_no, f"response has {len(response_ids)} tokens, more than "
                                        f"rollout.max_new_tokens={max_response_length}")
    logprobs: Optional[list[float]] = row.get("behaviour_logprobs")
    if logprobs is not None and len(logprobs) != len(response_ids):
        raise _row_error(file, line_no, f"'behaviour_logprobs' has {len(logprobs)} entries for "
                                        f"{len(response_ids)} response tokens (EOS included)")
    mask: Optional[list[int]] = row.get("response_mask")
    if mask is not None and len(mask) != len(response_ids):
        raise _row_error(file, line_no, f"'response_mask' has {len(mask)} entries for "
                                        f"{len(response_ids)} response tokens (EOS included)")
    key = row.get("group", f"__row{line_no}")
    group = group_index.setdefault(json.dumps(key), len(group_index))
    return Rollout(prompt_ids=list(prompt_ids), response_ids=list(response_ids), reward=float(row["reward"]),
                   group=group, truncated=truncated, behaviour_logprobs=logprobs, response_mask=mask,
                   prompt_text=row["prompt"], response_text=row["response"])
