"""Write the calculator example's inputs: a tiny chat model that has seen the tool-call format, and the problems.

    python examples/calculator/make_model.py [--out examples/calculator/work] [--steps 600] [--call-share 0.5]

Writes ``OUT/model`` (a 4-layer Llama, 0.88 M parameters, with a character-level ChatML tokenizer whose template
renders tools), ``OUT/train.jsonl`` (2000 problems) and ``OUT/eval.jsonl`` (100): ``{"prompt": [{"role": "user",
"content": "47*83=?"}], "answer": "3901"}``, both factors in 32..99 so every product has four digits.

Why a warm-up: a model initialised at random cannot discover a tool call by sampling: the call has to copy both
factors exactly, about 1 chance in 10^10 per try. So the model first imitates demonstrations (supervised, a few
minutes on the CPU). With the tool listed in the prompt, ``--call-share`` of them solve the problem with the
calculator (the call copies the factors, the answer copies the tool's result) and the others write the product
directly, which a model this small cannot compute; without tools they all write it directly. That sets how often the
warmed-up model calls at first, and what it earns without the tool. RL then finds out that calling pays
(README.md).

Why it learns to copy in a minute: every problem has the same format and length (two two-digit factors, a
four-digit product), so a factor's digit and its copy in the call, and the tool's result and the answer, are always
the same number of tokens apart; with rotary positions a copy at a fixed offset is easy to learn. The tokenizer holds
the constant parts of a call as two tokens, so a call is ``OPEN 4 7 * 8 3 CLOSE``.

The last lines printed measure the warmed-up model with greedy decoding on the eval problems: how often it calls,
how often a call copies the factors exactly, how often the answer after the tool's result copies it, and how often a
direct answer is right.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
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
BATCH = 32
MEASURE_EVERY = 200


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


class Demonstrations:
    """The ids of solved problems, built as the trainer's turn loop builds them: ``tools`` renders prompts with the
    calculator listed, ``plain`` without tools (the run without the tool)."""

    def __init__(self, tok):
        self.tok = tok
        self.tools = ChatTurns(tok, [get_json_schema(calculate)])
        self.plain = ChatTurns(tok, [])

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def call_ids(self, row: dict) -> list[int]:
        return self.ids(OPEN + row["prompt"][0]["content"].removesuffix("=?") + CLOSE) + [self.tok.eos_token_id]

    def segment_ids(self, row: dict) -> list[int]:
        return self.tools.tool_segment_ids([{"role": "tool", "name": "calculate", "content": row["answer"]}])

    def answer_ids(self, row: dict) -> list[int]:
        return self.ids(row["answer"]) + [self.tok.eos_token_id]

    def solved(self, row: dict, *, tools: bool, call: bool) -> tuple[list[int], list[int]]:
        """One solved problem's ids and the 0/1 mask of the assistant's tokens (what the warm-up learns)."""
        prompt = (self.tools if tools else self.plain).prompt_ids(row["prompt"])
        answer = self.answer_ids(row)
        if not call:
            return prompt + answer, [0] * len(prompt) + [1] * len(answer)
        turn, segment = self.call_ids(row), self.segment_ids(row)
        return (prompt + turn + segment + answer,
                [0] * len(prompt) + [1] * len(turn) + [0] * len(segment) + [1] * len(answer))


def warm_up(model, demos: Demonstrations, *, call_share: float, steps: int, lr: float, seed: int,
            eval_rows: list[dict]) -> None:
    """``steps`` batches of demonstrations: three in four list the tool, and ``call_share`` of those call it; the
    rest answer directly. AdamW at ``lr`` with a short linear warm-up and a cosine decay to a tenth."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = lambda s: min(1.0, (s + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    start = time.time()
    for step in range(steps):
        batch = []
        for _ in range(BATCH):
            tools = rng.random() < 0.75
            batch.append(demos.solved(problem(rng), tools=tools, call=tools and rng.random() < call_share))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[i if m else -100 for i, m in zip(ids, mask)] + [-100] * (width - len(ids))
                               for ids, mask in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"warm-up step {step}: loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
        if MEASURE_EVERY and step % MEASURE_EVERY == MEASURE_EVERY - 1:
            print(f"  {report(model, demos, eval_rows)}", flush=True)


@torch.no_grad()
def greedy(model, tok, inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of equal-length inputs (every prompt here has the same length), up to EOS."""
    out = model.generate(torch.tensor(inputs), attention_mask=torch.ones(len(inputs), len(inputs[0]), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    results = []
    for row in out[:, len(inputs[0]):].tolist():
        results.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return results


@torch.no_grad()
def sequence_probability(model, inputs: list[list[int]], targets: list[list[int]]) -> float:
    """The mean over rows of the probability that sampling at temperature 1 writes ``targets[r]`` after
    ``inputs[r]`` (inputs of equal length, targets of equal length)."""
    ids = torch.tensor([i + t for i, t in zip(inputs, targets)])
    logp = torch.log_softmax(model(input_ids=ids).logits[:, len(inputs[0]) - 1:-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(targets)[..., None]).sum((1, 2)).exp().mean().item()


@torch.no_grad()
def measure(model, demos: Demonstrations, rows: list[dict]) -> dict:
    """On ``rows``, with the tool listed: the probability that the first token opens a call; the share of calls
    (started by hand) that copy both factors exactly under greedy decoding, and the probability that sampling does;
    the same for the answer after the right tool result. Without tools: the share of greedy direct answers that are
    right, and the probability that sampling writes the right one."""
    model.eval()
    tok, open_id = demos.tok, demos.ids(OPEN)[0]
    prompts = [demos.tools.prompt_ids(r["prompt"]) for r in rows]
    calls = [demos.call_ids(r) for r in rows]
    answers = [demos.answer_ids(r) for r in rows]
    after = [p + c + demos.segment_ids(r) for p, c, r in zip(prompts, calls, rows)]
    plain = [demos.plain.prompt_ids(r["prompt"]) for r in rows]
    right = lambda outputs, targets: sum(o == t for o, t in zip(outputs, targets)) / len(rows)  # noqa: E731
    result = {
        "p_call": sequence_probability(model, prompts, [[open_id]] * len(rows)),
        "call_copies_factors": right([[open_id] + c for c in greedy(model, tok, [p + [open_id] for p in prompts], 12)],
                                     calls),
        "p_call_copies": sequence_probability(model, [p + [open_id] for p in prompts], [c[1:] for c in calls]),
        "answer_copies_result": right(greedy(model, tok, after, 8), answers),
        "p_answer_copies": sequence_probability(model, after, answers),
        "direct_right": right(greedy(model, tok, plain, 8), answers),
        "p_direct_right": sequence_probability(model, plain, answers)}
    model.train()
    return result


def report(model, demos: Demonstrations, rows: list[dict]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in measure(model, demos, rows).items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "work")
    parser.add_argument("--call-share", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    problems = {name: [problem(rng) for _ in range(count)] for name, count in (("train", 2000), ("eval", 100))}
    for name, rows in problems.items():
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tokenizer()
    demos = Demonstrations(tok)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    warm_up(model, demos, call_share=args.call_share, steps=args.steps, lr=args.lr, seed=args.seed + 1,
            eval_rows=problems["eval"])
    print(f"warmed up, on the eval problems: {report(model, demos, problems['eval'])}", flush=True)
    model.save_pretrained(args.out / "model")
    tok.save_pretrained(args.out / "model")
    print(f"wrote {args.out / 'model'}, {args.out / 'train.jsonl'}, {args.out / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
