"""fsdptrain sft's loss and masks (docs/sft.md), against hand computations.

The loss of a small batch of chats equals transformers' own causal-LM cross-entropy with the labels of every
non-assistant token set to -100, summed over the batch and divided by the global count of assistant tokens
(``num_items_in_batch``), for several micro-batch splits, and so do the gradients; non-assistant tokens get exactly
zero gradient; a chat's ids and mask equal the multi-turn rollout's built token-in/token-out by the turn loop.
"""

from __future__ import annotations

import pytest
import torch

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import ChatTurns, chat_response
from fsdptrain.data.demonstrations import DemoKeys, demonstration_ids, load_demonstrations
from fsdptrain.data.packing import PackPlan
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.sft_loss import sft_loss
from fsdptrain.rollout.turns import TurnCaps
from tests.helpers.scripted_decoder import scripted_turns
from fsdptrain.train.pack_losses import packed_sft_loss, SftLossSettings
from fsdptrain.train.sft import as_minibatch
from fsdptrain.train.step import accumulate_gradients, local_counts
from tests.helpers.chatml_tokenizer import CHATML_NO_TOOLS, chatml_tokenizer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "description": "Add.",
                                        "parameters": {"type": "object", "properties": {}}}}
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
     {"role": "assistant", "content": CALL}, {"role": "tool", "name": "add", "content": "5"},
     {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}],
    [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Teal"}],
    [{"role": "system", "content": "Count."}, {"role": "user", "content": "1 2"},
     {"role": "assistant", "content": "3 4 5"}],
]
SPLITS = [[[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0, 2], [1, 3]], [[3], [0, 1, 2]]]


@pytest.fixture(scope="module")
def tokenizer():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def demos(tokenizer):
    return [demonstration_ids({"messages": chat}, ["messages"], tokenizer=tokenizer, keys=DemoKeys())
            for chat in CHATS]


def tiny_model(tokenizer, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def hand_loss(model, demos) -> torch.Tensor:
    """transformers' own loss: labels -100 off the assistant's tokens, summed over the batch, over the global count
    of assistant tokens."""
    labels_of = [[-100] * len(p) + [t if m else -100 for t, m in zip(r, mask)] for p, r, mask in demos]
    num_items = sum(sum(1 for t in labels[1:] if t != -100) for labels in labels_of)
    total = 0.0
    for (prompt, response, _), labels in zip(demos, labels_of):
        ids = torch.tensor([prompt + response])
        total = total + model(input_ids=ids, labels=torch.tensor([labels]), num_items_in_batch=num_items).loss
    return total


def test_chat_ids_and_mask_by_hand(tokenizer):
    prompt, response, mask = chat_response(tokenizer, CHATS[1], tools=None)
    text = tokenizer.decode(prompt + response)
    assert text == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nBye.<|im_end|>")
    trained = tokenizer.decode([t for t, m in zip(response, mask) if m])
    assert trained == "Hello!<|im_end|>Bye.<|im_end|>"
    assert tokenizer.decode(prompt) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_mask_equals_the_multi_turn_rollouts(tokenizer):
    """The same conversation as a multi-turn rollout (the turn loop, scripted) and as a demonstration: the same
    prompt ids, response ids and response mask."""
    chat = ChatTurns(tokenizer, [ADD])
    prompt_messages = [{"role": "user", "content": "2+3?"}]
    turns = [tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
             tokenizer("It is 5.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]

    def generate(inputs, max_new, turn, samples):
        return [(turns[turn], True) for _ in inputs]

    class Result:
        content, failed, timed_out = "5", False, False

    (t,) = scripted_turns(chat, [chat.prompt_ids(prompt_messages)], generate=generate,
                     call_tools=lambda requests: [Result() for _ in requests],
                     caps=TurnCaps(max_turns=4, max_new_tokens=400, max_tool_response_tokens=50))
    assert t.num_calls == 1 and t.num_turns == 2
    conversation = prompt_messages + [{k: v for k, v in m.items() if k != "tool_calls"} for m in t.messages]
    assert chat_response(tokenizer, conversation, tools=[ADD]) == (t.prompt_ids, t.response_ids, t.response_mask)


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: str(s))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_gradients_equal_transformers_cross_entropy(tokenizer, demos, split, tied):
    """Tied: the output head is the input embedding (as SmolLM2's), so its gradient sums both uses. The chunks of
    the fused head (7 trained tokens each) end inside sequences: the chunked head equals the full logits there too."""
    model = tiny_model(tokenizer, tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert any(0 < 7 - sum(sum(d[2]) for d in demos[:k]) < sum(d[2]) for k, d in enumerate(demos)), \
        "no chunk boundary falls inside a sequence's trained tokens"
    reference = hand_loss(model, demos)
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    set_attention(model, "sdpa_segments")
    from fsdptrain.data.demonstrations import Demonstration

    batch = as_minibatch([Demonstration(i, *d) for i, d in enumerate(demos)])
    num_tokens, num_seqs = local_counts(batch)
    norms = LossNormalizers(global_num_tokens=num_tokens, global_num_seqs=num_seqs)
    lengths = batch.lengths()
    plan = PackPlan(split, [sum(lengths[i] for i in p) for p in split], [1.0] * len(split), 4096)
    done = accumulate_gradients(model, batch, loss_fn=packed_sft_loss, norms=norms, token_budget=4096,
                                device=torch.device("cpu"), plan=plan,
                                settings=SftLossSettings(agg_mode="token-mean", chunk_size=7))
    assert abs(done.loss - float(reference.detach())) <= 1e-6, (done.loss, float(reference.detach()))
    worst = max(float((p.grad - expected[n]).abs().max()) for n, p in model.named_parameters())
    assert worst <= 1e-6, worst
    head = model.get_output_embeddings().weight
    assert float((head.grad - expected["lm_head.weight" if not tied else "model.embed_tokens.weight"]).abs().max()) \
        <= 1e-6
    logged = done.metrics["loss"].value()
    assert abs(logged - float(reference.detach())) <= 1e-6


def test_non_assistant_tokens_get_zero_gradient():
    """Per token: -1/N at a trained token, exactly 0 elsewhere, even where the log-prob is NaN; the loss by hand."""
    logprobs = torch.tensor([-1.0, float("nan"), -2.0, -0.5, -3.0, float("nan")], requires_grad=True)
    mask = torch.tensor([1, 0, 1, 0, 1, 0])
    cu = torch.tensor([0, 3, 6])
    norms = LossNormalizers(global_num_tokens=6, global_num_seqs=2, dp_size=2)  # 3 more trained tokens elsewhere
    loss, metrics = sft_loss(logprobs, mask, norms=norms, agg_mode="token-mean", cu_seqlens=cu)
    assert float(loss.detach()) == pytest.approx((1.0 + 2.0 + 3.0) / 6 * 2, abs=1e-7)
    assert metrics["loss"].value() == pytest.approx(1.0, abs=1e-7)
    assert metrics["nll"].value() == pytest.approx(2.0, abs=1e-7)
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([-1 / 3, 0.0, -1 / 3, 0.0, -1 / 3, 0.0], abs=1e-7)
    assert [logprobs.grad[i].item() for i in (1, 3, 5)] == [0.0, 0.0, 0.0]


def test_prompt_and_completion_rows(tokenizer):
    keys = DemoKeys()
    prompt, response, mask = demonstration_ids({"prompt": "2+2=", "completion": "4"}, ["prompt", "completion"],
                                               tokenizer=tokenizer, keys=keys)
    assert tokenizer.decode(prompt) == "2+2=" and tokenizer.decode(response) == "4<|im_end|>" and mask == [1, 1]
    chat = demonstration_ids({"prompt": [{"role": "user", "content": "Hi"}], "completion": "Yo"},
                             ["prompt", "completion"], tokenizer=tokenizer, keys=keys)
    assert tokenizer.decode([t for t, m in zip(chat[1], chat[2]) if m]) == "Yo<|im_end|>"


@pytest.mark.parametrize("row, message", [
    ({"prompt": "2+2=", "completion": 4}, "column 'completion': expected a string or a non-empty list of .* got int 4"),
    ({"prompt": None, "completion": "4"}, "column 'prompt': expected a string or a non-empty list of .* got NoneType"),
    ({"prompt": "2+2=", "completion": [{"role": "assistant", "content": "4"}]},
     "column 'prompt' is a string but 'completion' is a list of messages"),
])
def test_a_prompt_completion_row_of_the_wrong_types_names_the_column_at_fault(tokenizer, row, message):
    with pytest.raises(ValueError, match=message):
        demonstration_ids(row, ["prompt", "completion"], tokenizer=tokenizer, keys=DemoKeys())


def test_bad_rows_are_one_line(tokenizer, tmp_path):
    import json

    def write(rows) -> str:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    load = dict(tokenizer=tokenizer, keys=DemoKeys(), token_budget=60)
    with pytest.raises(ConfigError, match=r"row 1 \(0-based\): it has no assistant message"):
        load_demonstrations(write([{"messages": CHATS[2]}, {"messages": [{"role": "user", "content": "Hi"}]}]),
                            **load)
    with pytest.raises(ConfigError, match=r"row 0 \(0-based\) is 168 tokens, more than trainer.token_budget=60"):
        load_demonstrations(write([{"messages": CHATS[0]}]), **load)
    # within the budget but past the model's positions: refused (RoPE past them computes angles never trained at)
    with pytest.raises(ConfigError, match=r"row 0 \(0-based\) is 168 tokens, past the model's "
                                          r"max_position_embeddings=167: shorten the row"):
        load_demonstrations(write([{"messages": CHATS[0]}]), **{**load, "token_budget": 999, "max_positions": 167})
    assert len(load_demonstrations(write([{"messages": CHATS[0]}]),
                                   **{**load, "token_budget": 999, "max_positions": 168})) == 1
    drops_tools = chatml_tokenizer(CHATML_NO_TOOLS.replace("{% for m in messages %}",
                                                           "{% for m in messages if m.role != 'tool' %}"))
    with pytest.raises(ConfigError, match="drops its 'tool' message"):
        load_demonstrations(write([{"messages": CHATS[0]}]), **{**load, "tokenizer": drops_tools, "token_budget": 999})
    raises = chatml_tokenizer("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                              "{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError, match="cannot render this chat .roles system, user, assistant.*no system"):
        load_demonstrations(write([{"messages": CHATS[3]}]), **{**load, "tokenizer": raises})
