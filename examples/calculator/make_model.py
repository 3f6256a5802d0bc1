"""Write the calculator example's inputs: a tiny chat model, the demonstrations its warm-up imitates, and the problems;
or measure a warmed-up model.

    python examples/calculator/make_model.py [--out examples/calculator/work] [--demos 19200] [--call-share 0.5]
    python examples/calculator/make_model.py --measure runs/calculator-warmup/export/policy [--out ...]

Writes ``OUT/model`` (a 4-layer Llama, 0.88 M parameters, initialised at random, with a character-level ChatML
tokenizer whose template renders tools), ``OUT/demos.jsonl`` (``--demos`` solved problems as chats: the warm-up's
data for ``fsdptrain sft``) and ``OUT/demos_eval.jsonl`` (100 more, held out), ``OUT/train.jsonl`` (2000 problems)
and ``OUT/eval.jsonl`` (100): ``{"prompt": [{"role": "user", "content": "47*83=?"}], "answer": "3901"}``, both
factors in 32..99 so every product has four digits.

Why a warm-up: a model initialised at random cannot discover a tool call by sampling: the call has to copy both
factors exactly, about 1 chance in 10^10 per try. So the model first imitates demonstrations (``fsdptrain sft``, a
few minutes on the CPU: README.md). Three in four list the tool (the ``tools`` column), and ``--call-share`` of those
solve the problem with the calculator (an assistant turn that calls it, the tool's message with the result, an
assistant turn that copies the result) while the others write the product directly, which a model this small cannot
compute; without tools they all write it directly. That sets how often the warmed-up model calls at first, and what
it earns without the tool. RL then finds out that calling pays (README.md).

Why it learns to copy in a few hundred steps: every problem has the same format and length (two two-digit factors,
a four-digit product), so a factor's digit and its copy in the call, and the tool's result and the answer, are
always the same number of tokens apart; with rotary positions a copy at a fixed offset is easy to learn. The
tokenizer holds the constant parts of a call as two tokens, so a call is ``OPEN 4 7 * 8 3 CLOSE``.

``--measure MODEL`` measures a model folder on the eval problems (README.md's table): how often it opens a call,
how often a call copies the factors exactly, how often the answer after the tool's result copies it, and how often a
direct answer is right (greedy decoding, and the probability that sampling at temperature 1 writes each).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


class Demonstrations:
    """The ids the measurements feed the model, built as the trainer's turn loop builds them: ``tools`` renders
    prompts with the calculator listed, ``plain`` without tools (the run without the tool)."""

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


def chat(row: dict, *, tools: bool, call: bool) -> dict:
    """One solved problem as a demonstration row of ``fsdptrain sft``: the user's question and the assistant's
    answer, with (``call``) an assistant turn that calls the calculator and the tool's message with its result in
    between; ``tools`` lists the calculator's schema for the template."""
    question, answer = row["prompt"][0]["content"], row["answer"]
    messages = list(row["prompt"])
    if call:
        expression = question.removesuffix("=?")
        messages += [{"role": "assistant", "content": OPEN + expression + CLOSE,
                      "tool_calls": [{"type": "function",
                                      "function": {"name": "calculate", "arguments": {"expression": expression}}}]},
                     {"role": "tool", "name": "calculate", "content": calculate(expression)}]
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, **({"tools": [get_json_schema(calculate)]} if tools else {})}


def demonstrations(rng: random.Random, count: int, *, call_share: float) -> list[dict]:
    """``count`` solved problems: three in four list the tool, and ``call_share`` of those call it; the rest answer
    directly."""
    rows = []
    for _ in range(count):
        tools = rng.random() < 0.75
        rows.append(chat(problem(rng), tools=tools, call=tools and rng.random() < call_share))
    return rows


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


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "work")
    parser.add_argument("--call-share", type=float, default=0.5)
    parser.add_argument("--demos", type=int, default=600 * 32, help="demonstrations (the warm-up's 600 steps of 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", type=Path, help="measure this model folder on OUT/eval.jsonl instead")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    if args.measure is not None:
        rows = [json.loads(line) for line in (args.out / "eval.jsonl").read_text().splitlines()]
        model = LlamaForCausalLM.from_pretrained(args.measure)
        demos = Demonstrations(AutoTokenizer.from_pretrained(args.measure))
        print(f"{args.measure}, on the eval problems: {report(model, demos, rows)}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    problems = {name: [problem(rng) for _ in range(count)] for name, count in (("train", 2000), ("eval", 100))}
    for name, rows in problems.items():
        write_jsonl(args.out / f"{name}.jsonl", rows)
    write_jsonl(args.out / "demos.jsonl",
                demonstrations(random.Random(args.seed + 1), args.demos, call_share=args.call_share))
    write_jsonl(args.out / "demos_eval.jsonl",
                demonstrations(random.Random(args.seed + 2), 100, call_share=args.call_share))
    tok = build_tokenizer()
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    model.save_pretrained(args.out / "model")
    tok.save_pretrained(args.out / "model")
    print(f"wrote {args.out / 'model'}, {args.out / 'demos.jsonl'} ({args.demos} demonstrations), "
          f"{args.out / 'demos_eval.jsonl'}, {args.out / 'train.jsonl'}, {args.out / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
