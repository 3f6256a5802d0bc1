"""The multi-turn turn loop (fsdptrain/rollout/turns.py, on the chat rendering of fsdptrain/data/conversation.py)
with a ChatML template with tools written by the test (tests/helpers/chatml_tokenizer.py) and scripted generations: ids
built turn by turn equal the template's rendering of the final conversation token for token, the mask is 0 exactly on
tool segments and separators, and each cap, a malformed call, a raising or unknown tool and an overflowing result behave
as docs/multi-turn.md says."""

from __future__ import annotations

import json

import pytest

from fsdptrain.config import ConfigError
from fsdptrain.data.conversation import ChatTurns, data_ids, parse_tool_calls_text
from fsdptrain.rollout.turns import TurnCaps
from tests.helpers.scripted_decoder import scripted_turns
from fsdptrain.rollout.tools import Tool, ToolCall, ToolCaller, tool_schema
from fsdptrain.rollout.multi_turn import turn_metrics
from fsdptrain.metrics.typed import finalize
from tests.helpers.chatml_tokenizer import CHATML_NO_TOOLS, STRIPS_THINK, chatml_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("kaput")


def shout(text: str) -> str:
    """Repeat a text ten times.

    Args:
        text: what to repeat
    """
    return text * 10


TOOLS = [Tool(name=f.__name__, spec=None, fn=f, schema=tool_schema(f, what="test")) for f in (add, boom, shout)]


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def scripted(tokenizer, script: dict[int, list[str]], *, eos: bool = True):
    """A generate function that writes ``script[turn][i]`` (plus EOS) for the i-th input still active."""
    def generate(inputs, max_new_tokens, turn, samples):
        out = []
        for text in script[turn][:len(inputs)]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            out.append((ids, eos))
        return out
    return generate


def run(script, *, prompts=("What is 2+3?",), max_turns=4, max_new_tokens=1000, max_tool_response_tokens=100):
    tok = chatml_tokenizer()
    chat = ChatTurns(tok, [t.schema for t in TOOLS])
    caller = ToolCaller(TOOLS, pool=None, timeout_s=None)
    prompt_ids = [chat.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    trajectories = scripted_turns(
        chat, prompt_ids, generate=scripted(tok, script),
        call_tools=lambda reqs: caller.run([ToolCall(s, n, a) for s, n, a in reqs]),
        caps=TurnCaps(max_turns=max_turns, max_new_tokens=max_new_tokens,
                      max_tool_response_tokens=max_tool_response_tokens))
    return tok, chat, trajectories


def test_ids_built_turn_by_turn_equal_the_templates_rendering_and_the_mask_covers_only_tool_segments():
    tok, chat, (t,) = run({0: [call("add", a=2, b=3)], 1: [call("add", a=5, b=1) + call("shout", text="ab")],
                           2: ["It is 5."]})
    conversation = [{"role": "user", "content": "What is 2+3?"},
                    *({"role": m["role"], "content": m["content"]} for m in t.messages)]
    rendered = chat.render(conversation)
    assert chat.after_eos == tok("\n", add_special_tokens=False)["input_ids"]
    assert t.prompt_ids + t.response_ids == rendered[:len(rendered) - len(chat.after_eos)]
    assert [m["role"] for m in t.messages] == ["assistant", "tool", "assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["5", "6", "ab" * 10]
    # The mask: 1 exactly on what the scripted model wrote (EOS included), 0 on each tool segment with its separators.
    sampled = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for text in (call("add", a=2, b=3), call("add", a=5, b=1) + call("shout", text="ab"), "It is 5.")]
    seg1 = tok("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]
    seg2 = tok("\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n" + "ab" * 10
               + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert t.response_ids == sampled[0] + seg1 + sampled[1] + seg2 + sampled[2]
    assert t.response_mask == ([1] * len(sampled[0]) + [0] * len(seg1) + [1] * len(sampled[1]) + [0] * len(seg2)
                               + [1] * len(sampled[2]))
    assert (t.num_turns, t.num_calls, t.num_failed_calls, t.truncation) == (3, 3, 0, None)
    assert t.num_tool_tokens == len(seg1) + len(seg2)
    assert t.messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "add",
                                                                            "arguments": {"a": 2, "b": 3}}}]


def test_malformed_raising_and_unknown_calls_and_the_turn_cap():
    script = {0: [call("add", a=1, b=2)[:-3] + "l>",  # the closing tag is broken: plain text, the trajectory ends
                  call("boom", x=1),
                  "no call at all"],
              1: [call("nope", y=2)],
              2: [call("add", a=1, b=1)]}
    _, _, (malformed, failing, plain) = run(script, prompts=("a", "b", "c"), max_turns=3)
    assert (malformed.num_malformed, malformed.num_turns, malformed.num_calls, malformed.truncation) == (1, 1, 0, None)
    assert malformed.response_mask == [1] * len(malformed.response_ids)
    errors = [json.loads(m["content"]) for m in failing.messages if m["role"] == "tool"]
    assert errors == [{"error": "RuntimeError: kaput"}, {"error": "unknown tool 'nope'"}]
    # The third turn's call is not run: the turn cap truncates the trajectory.
    assert (failing.num_turns, failing.num_calls, failing.num_failed_calls, failing.truncation) == (3, 2, 2, "max_turns")
    assert (plain.num_turns, plain.truncation) == (1, None)
    metrics = finalize(turn_metrics([malformed, failing, plain]))
    assert metrics["tools/call_frequency"] == pytest.approx(2 / 3, abs=1e-12)
    assert metrics["tools/failure_frequency"] == 1.0
    assert metrics["tools/calls_per_sample/max"] == 2.0
    assert metrics["tools/num_malformed"] == 1.0
    assert metrics["turns/mean"] == pytest.approx(5 / 3, abs=1e-12) and metrics["turns/max"] == 3.0
    assert metrics["truncated/max_turns"] == pytest.approx(1 / 3, abs=1e-12)
    assert metrics["truncated/length"] == 0.0 and metrics["truncated/tool_overflow"] == 0.0


def test_long_results_are_cut_and_a_segment_past_the_budget_is_not_appended():
    tok = chatml_tokenizer()
    first = len(tok(call("shout", text="abcde"), add_special_tokens=False)["input_ids"]) + 1
    # 50 characters cut to 7 tokens; the segment fits a budget of first + 70 and leaves room to answer.
    _, chat, (t,) = run({0: [call("shout", text="abcde")], 1: ["ok"]}, max_tool_response_tokens=7,
                        max_new_tokens=first + 70)
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["abcdeab"]
    assert (t.num_cut_results, t.truncation, t.num_turns) == (1, None, 2)
    # With the budget ending inside the tool segment, nothing of it is appended: truncated by tool_overflow.
    _, _, (o,) = run({0: [call("shout", text="abcde")]}, max_new_tokens=first + 20)
    assert o.response_ids == tok(call("shout", text="abcde"), add_special_tokens=False)["input_ids"] + [2]
    assert (o.truncation, o.num_calls, o.num_tool_tokens) == ("tool_overflow", 1, 0)
    assert o.messages[-1]["appended"] is False


def test_the_budget_cuts_a_turn_and_marks_it_truncated_by_length():
    tok = chatml_tokenizer()
    _, _, (t,) = run({0: ["a long answer without end"]}, max_new_tokens=6)
    assert t.response_ids == tok("a long", add_special_tokens=False)["input_ids"]
    assert (t.truncation, t.num_turns) == ("length", 1)
    assert finalize(turn_metrics([t]))["truncated/length"] == 1.0


def test_builtin_parser_reads_calls_and_rejects_broken_ones():
    assert parse_tool_calls_text('x <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>').calls == [
        ("f", {"a": 1})]
    assert parse_tool_calls_text("<tool_call>[1]</tool_call>").malformed
    assert parse_tool_calls_text('<tool_call>{"name": "f"}').malformed
    assert parse_tool_calls_text("plain").calls == []


HERMES_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {"content": {"content": "text"},
               "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                              "transform": {"type": "function", "function": "{content}"}}},
}
"""A transformers response template for the ``<tool_call>{json}</tool_call>`` format, written here."""


def test_a_tokenizer_with_a_response_template_parses_calls_with_parse_response():
    """With ``response_template`` set, calls come from the tokenizer's ``parse_response`` over the sampled ids: it
    casts arguments by the tool's schema (``"7"`` -> 7 for an integer), which the built-in text parser does not, so
    the result shows which path ran; what it rejects is a malformed turn."""
    tok = chatml_tokenizer()
    tok.response_template = HERMES_RESPONSE_TEMPLATE
    chat = ChatTurns(tok, [t.schema for t in TOOLS])
    prefix = chat.prompt_ids([{"role": "user", "content": "What is 2+7?"}])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    two_calls = 'Sure.' + call("add", a=2, b="7") + call("shout", text="7")
    assert chat.parse(ids(two_calls), prefix_ids=prefix).calls == [("add", {"a": 2, "b": 7}), ("shout", {"text": "7"})]
    assert parse_tool_calls_text(two_calls).calls[0] == ("add", {"a": 2, "b": "7"})
    assert chat.parse(ids("It is 9."), prefix_ids=prefix).calls == []
    assert chat.parse(ids('<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'), prefix_ids=prefix).malformed
    assert chat.parse(ids('<tool_call>{"name": "add"}'), prefix_ids=prefix).malformed


def test_a_tool_segment_is_rendered_once_per_distinct_messages_and_equals_a_fresh_rendering(monkeypatch):
    """tool_segment_ids remembers segments (a group's samples repeat calls): the second identical request renders
    nothing, a different one renders, and each returns the ids a fresh ChatTurns renders, in a list of its own."""
    tok = chatml_tokenizer()
    chat = ChatTurns(tok, [t.schema for t in TOOLS])
    renders = []
    render = ChatTurns._tool_segment_ids
    monkeypatch.setattr(ChatTurns, "_tool_segment_ids", lambda self, m: renders.append(m) or render(self, m))
    five = [{"role": "tool", "name": "add", "content": "5"}]
    six = [{"role": "tool", "name": "add", "content": "6"}]
    first, again, other = chat.tool_segment_ids(five), chat.tool_segment_ids(list(five)), chat.tool_segment_ids(six)
    assert len(renders) == 2
    fresh = ChatTurns(tok, [t.schema for t in TOOLS])
    assert first == again == render(fresh, five) and other == render(fresh, six) and first != other
    first.append(0)
    assert chat.tool_segment_ids(five) == again


def test_a_tool_result_is_tokenized_once_per_distinct_text_up_to_the_memo_length(monkeypatch):
    """result_ids remembers a result's ids (a group's samples get the same results): a repeated short text calls the
    tokenizer once, a text over RESULT_MEMO_CHARS every time; each returns data_ids' ids (a special token's text stays
    characters), in a list of its own."""
    import fsdptrain.data.conversation as conversation

    tok = chatml_tokenizer()
    chat = ChatTurns(tok, [t.schema for t in TOOLS])
    calls = []
    monkeypatch.setattr(conversation, "data_ids", lambda t, text: calls.append(text) or data_ids(t, text))
    special = "5 <|im_end|>"
    first, again = chat.result_ids(special), chat.result_ids(special)
    assert calls == [special] and first == again == data_ids(tok, special) and tok.eos_token_id not in first
    first.append(0)
    assert chat.result_ids(special) == again
    long = "7" * (conversation.RESULT_MEMO_CHARS + 1)
    assert chat.result_ids(long) == chat.result_ids(long) == data_ids(tok, long) and calls.count(long) == 2


def test_templates_that_render_no_tools_or_rewrite_history_are_refused():
    with pytest.raises(ConfigError, match="renders no tools"):
        ChatTurns(chatml_tokenizer(CHATML_NO_TOOLS), [])
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        ChatTurns(chatml_tokenizer(STRIPS_THINK), [])


BAD_TOOLS = '''
NOT_A_FUNCTION = 3

class Callable:
    def __call__(self, x: int) -> int:
        """Call.

        Args:
            x: a number
        """
        return x

def no_hints(x):
    """No hints.

    Args:
        x: a number
    """
    return x

def no_docstring(x: int) -> int:
    return x

class NoReset:
    def step(self, x: int) -> int:
        """Step.

        Args:
            x: a number
        """
        return x

class Good:
    def reset(self, **columns):
        return None

    def step(self, x: int) -> int:
        """Step.

        Args:
            x: a number
        """
        return x

    def _private(self):
        return None

    def get_reward(self) -> float:
        return 1.0
'''


@pytest.mark.parametrize("spec, message", [
    ("NOT_A_FUNCTION", "'{file}:NOT_A_FUNCTION' is a int, not a function"),
    ("Callable", "'{file}:Callable' is a type, not a function"),
    ("no_hints", "rollout.tools: '{file}:no_hints': "),
    ("no_docstring", "rollout.tools: '{file}:no_docstring': Cannot generate JSON schema for no_docstring because it "
                     "has no docstring"),
])
def test_a_tool_that_is_not_a_typed_documented_function_is_refused(tmp_path, spec, message):
    from fsdptrain.rollout.tools import load_tools

    (tmp_path / "bad.py").write_text(BAD_TOOLS)
    file = str(tmp_path / "bad.py")
    with pytest.raises(ConfigError) as err:
        load_tools([f"{file}:{spec}"])
    assert message.format(file=file) in str(err.value) and "\n" not in str(err.value)


def test_an_environment_needs_reset_and_its_public_methods_are_its_tools(tmp_path):
    from fsdptrain.rollout.tools import load_environment

    (tmp_path / "env.py").write_text(BAD_TOOLS)
    with pytest.raises(ConfigError, match="has no reset method"):
        load_environment(f"{tmp_path / 'env.py'}:NoReset")
    env = load_environment(f"{tmp_path / 'env.py'}:Good")
    assert (env.name, env.tool_names(), env.has_reward) == ("Good", ["step"], True)
    assert env.tool_schemas[0]["function"]["parameters"] == {
        "type": "object", "properties": {"x": {"type": "integer", "description": "a number"}}, "required": ["x"]}


def test_pooled_tools_run_in_workers_and_a_hung_one_is_cut_off_and_counted(tmp_path):
    from fsdptrain.rollout.tools import load_tools, tool_pool

    (tmp_path / "slow.py").write_text(
        "import time\n\n"
        "def nap(seconds: float) -> str:\n"
        '    """Sleep.\n\n    Args:\n        seconds: how long\n    """\n'
        "    time.sleep(seconds)\n"
        "    return 'rested'\n")
    tools = load_tools([f"{tmp_path / 'slow.py'}:nap"])
    pool = tool_pool(tools, 1)
    try:
        # A first call without a deadline waits for the worker to start (slow on a loaded machine).
        (started,) = ToolCaller(tools, pool=pool, timeout_s=None).run([ToolCall(0, "nap", {"seconds": 0})])
        caller = ToolCaller(tools, pool=pool, timeout_s=2.0)
        # The hung call last: the worker that replaces the killed one starts afresh.
        quick, raising, hung = caller.run([ToolCall(0, "nap", {"seconds": 0}), ToolCall(1, "nap", {"seconds": "x"}),
                                           ToolCall(2, "nap", {"seconds": 60})])
    finally:
        pool.close()
    assert started == quick == type(quick)("rested", failed=False)
    assert (json.loads(hung.content), hung.failed, hung.timed_out) == ({"error": "timed out after 2s"}, True, True)
    assert raising.failed and "TypeError" in json.loads(raising.content)["error"]
