"""Write the calculator example's inputs: a tiny chat model that has seen the tool-call format, and the problems.

    python examples/calculator/make_model.py [--out examples/calculator/work] [--call-share 0.3]

Writes ``OUT/model`` (a 2-layer Llama with a character-level ChatML tokenizer whose template renders tools),
``OUT/train.jsonl`` (2000 problems) and ``OUT/eval.jsonl`` (100): ``{"prompt": [{"role": "user", "content":
"47*83=?"}], "answer": "3901"}``, both factors in 32..99 so every product has four digits.

Why a warm-up: a model initialised at random cannot discover a tool call by sampling: the call has to copy both
factors exactly, about 1 chance in 10^10 per try. So the model first imitates a few hundred correct demonstrations
(supervised, a few minutes on the CPU): first ``--steps`` batches of demonstrations that solve the problem with the
calculator (the call copies the factors, the answer copies the tool's result: what takes long to learn), then
``--mix-steps`` batches in which only ``--call-share`` of them call and the others write the product directly, which
a model this small cannot compute. That sets how often the warmed-up model calls at first. RL then finds out that
calling pays: the share of samples that call and the reward rise together (README.md). The tokenizer holds the
constant parts of a call as two tokens, so a call is ``OPEN 4 7 * 8 3 CLOSE``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from transformers.utils import get_json_schema

from fsdptrain.data.conversation import ChatTurns

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator import calculate  # noqa: E402  (the example's own tool, next to this file)

OPEN = '<tool_call>{"name": "calculate", "arguments": {"expression": "'
CLOSE = '"}}</tool_call>'
TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}tools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")
"""ChatML; tools are listed by name in a system turn (the model needs no schema to learn one tool)."""
LOW, HIGH = 32, 99


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline, ChatML's two special tokens (EOS: ``<|im_end|>``), and
    the two constant parts of a calculator call."""
    chars = ["\n", *[chr(c) for c in range(32, 127)]]
    vocab = {t: i for i, t in enumerate(["<pad>", "<|im_start|>", "<|im_end|>", "<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<unk>", padding_side="left")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.add_tokens([OPEN, CLOSE])
    fast.chat_template = TEMPLATE
    return fast


def problem(rng: random.Random) -> dict:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    return {"prompt": [{"role": "user", "content": f"{a}*{b}=?"}], "answer": str(a * b)}


def demonstration(tok, chat: ChatTurns, row: dict, *, call: bool) -> tuple[list[int], list[int]]:
    """The ids of one solved problem, built as the trainer's turn loop builds them, and the 0/1 mask of the
    assistant's tokens (what the warm-up learns)."""
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = chat.prompt_ids(row["prompt"])
    answer = ids(row["answer"]) + [tok.eos_token_id]
    if not call:
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    expression = row["prompt"][0]["content"].removesuffix("=?")
    turn = ids(OPEN + expression + CLOSE) + [tok.eos_token_id]
    segment = chat.tool_segment_ids([{"role": "tool", "name": "calculate", "content": row["answer"]}])
    return (prompt + turn + segment + answer,
            [0] * len(prompt) + [1] * len(turn) + [0] * len(segment) + [1] * len(answer))


def warm_up(model, tok, chat, *, call_share: float, steps: int, mix_steps: int, seed: int) -> None:
    """``steps`` of calling demonstrations only (copying the factors and the result is what takes long to learn),
    then ``mix_steps`` in which ``call_share`` of the demonstrations call: the first token's prior to call."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps + mix_steps):
        share = 1.0 if step < steps else call_share
        batch = [demonstration(tok, chat, problem(rng), call=rng.random() < share) for _ in range(32)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[i if m else -100 for i, m in zip(ids, mask)] + [-100] * (width - len(ids))
                               for ids, mask in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps + mix_steps - 1:
            print(f"warm-up step {step}: loss {loss.item():.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "work")
    parser.add_argument("--call-share", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--mix-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, count in (("train", 2000), ("eval", 100)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(problem(rng)) + "\n" for _ in range(count)))
    tok = build_tokenizer()
    chat = ChatTurns(tok, [get_json_schema(calculate)])
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    warm_up(model, tok, chat, call_share=args.call_share, steps=args.steps, mix_steps=args.mix_steps,
            seed=args.seed + 1)
    model.save_pretrained(args.out / "model")
    tok.save_pretrained(args.out / "model")
    print(f"wrote {args.out / 'model'}, {args.out / 'train.jsonl'}, {args.out / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
