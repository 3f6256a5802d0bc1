"""Rollouts: one sequence of experience each, and the split of a generated tail into a response.

A :class:`Rollout` is one sequence: prompt ids, response ids, a reward, its prompt group's global index and whether it
was truncated. The policy samples them through fsdptrain/generation/generate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Rollout:
    """One sequence of experience; ids exclude padding, the response ends with EOS unless it was truncated.

    ``response_mask`` holds one 0/1 entry per response token: 1 where the policy sampled the token, 0 where a tool,
    the environment or a chat separator wrote it (a multi-turn rollout). ``None`` means all ones (every single-turn
    rollout). It is the one record of which tokens count: packing turns it into the packed row's ``response_mask``
    and the loss, its normalisers, KL, entropy, advantages and metrics read only that (docs/architecture.md).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    group: int
    truncated: bool = False
    behaviour_logprobs: Optional[list[float]] = None
    """Off-policy only: the log-probs of the policy that wrote the response (offline data), one per response token.
    A rollout carrying them makes the step off-policy (the old log-prob pass runs; rollout correction reads them)."""
    generation_logprobs: Optional[list[float]] = None
    """On-policy marker: the log-probs the generating forward of the current weights computed at each sampled token
    (``log_softmax(logits / temperature)``: after temperature, before top-p), one per response token. A diagnostic
    only: it never replaces the old log-probs, never makes a step off-policy and never enters the loss; the trainer
    logs its gap to the training forward as ``rollout/logprob_diff/*`` (docs/rollout.md)."""
    response_mask: Optional[list[int]] = None
    routes: Optional[Tensor] = None
    """A mixture-of-experts policy's routes recorded at generation (docs/moe.md, "Routing replay"): ``[L, n, k]``
    uint8 (int16 beyond 256 experts), the experts each MoE layer chose for the first ``n`` positions of prompt +
    response (every position but the last: the engines' forwards never read the last sampled token); None: not
    recorded. Replayed in the experience and update forwards with ``model.moe.routing_replay``."""
    prompt_text: str = ""
    response_text: str = ""
    extra: dict = field(default_factory=dict)


def split_response(generated: Sequence[int], *, eos_id: int) -> tuple[list[int], bool]:
    """The response up to and including the first EOS, and whether it hit the length limit instead (truncated).

    ``generated`` holds the new tokens only; what follows the first EOS is ``generate``'s padding of a finished row
    and is dropped. A row with no EOS ran to the limit: every token was sampled (a sampled pad id included) and kept.
    """
    out: list[int] = []
    for token in generated:
        out.append(int(token))
        if token == eos_id:
            return out, False
    return out, True


