"""Multi-turn training end to end (docs/multi-turn.md): the real CLI trains a tiny model written here, whose
character-level ChatML tokenizer (tests/chatml.py) holds a whole tool call as one added token, so a random policy
calls tools from the first step; with a tool and with an environment class; resume after step 2 equals the
uninterrupted run; 1 and 2 ranks give the same metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chatml import chatml_tokenizer
from tests.conftest import metric_kinds, without_diagnostics

ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
INCREMENT_CALL = '<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>'

TOOLS_PY = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''

ENV_PY = '''
class Counter:
    """A counter the model increments; its reward is the count."""

    def reset(self, **columns):
        self.count = 0
        return " (start at 0)"

    def increment(self, by: int) -> int:
        """Increment the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)
'''

REWARD_PY = '''
def said_five(prompts, completions, completion_ids, answer, **kwargs):
    """1 when a tool message of the conversation holds the answer."""
    return [float(any(m["role"] == "tool" and m["content"] == answer for m in c)) for c in completions]


def saw_environments(prompts, completions, completion_ids, environments, **kwargs):
    """The environment's count again, read through the environments= argument."""
    return [float(e.count) for e in environments]
'''


def write_inputs(folder: Path) -> Path:
    """The model folder, the prompts, the tools, the environment and the rewards, under ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chatml_tokenizer(extra_tokens=(ADD_CALL, INCREMENT_CALL))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # A large constant first embedding dimension makes every final hidden state point about the same way, so
        # lm_head's first column acts as a bias: the two call tokens and EOS get about 14% each, any other token
        # under 1%. The policy is nearly context-free but calls tools from the first step, over several turns.
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[[2, len(tokenizer) - 2, len(tokenizer) - 1], 0] = 0.57
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tools.py").write_text(TOOLS_PY)
    (folder / "env.py").write_text(ENV_PY)
    (folder / "rewards.py").write_text(REWARD_PY)
    return folder
