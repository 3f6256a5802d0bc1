"""Packed forwards of tiny HF decoders built from configs: equal to each sequence's own forward, no leakage,
equal gradients, and generation untouched by the packed backend (fsdptrain/model/attention_switch.py + packing.py).

Every packed forward asserts through `tests/helpers/attention_call_counts.py` that `sdpa_segments` served each layer, so
transformers' own packed-mask path (plain sdpa) cannot be what makes these tests pass.
"""

import contextlib

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from fsdptrain.data.packing import pack_sequences, unpack
from fsdptrain.model.attention_switch import (
    generation_attention,
    packed_attention,
    packed_model_inputs,
    set_attention,
)
from tests.helpers.attention_call_counts import call_counts, reset_call_counts

VOCAB = 64
NUM_LAYERS = 2
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA everywhere
    max_position_embeddings=128,
    pad_token_id=0,
)
WINDOW = 4  # shorter than most sequences below, so the window changes the result


@contextlib.contextmanager
def _no_window(model):
    model.config.sliding_window = None  # Mistral reads the config at forward time (mask and attention)
    yield
    model.config.sliding_window = WINDOW


@contextlib.contextmanager
def _no_softcap(model):
    layers = [layer.self_attn for layer in model.model.layers]
    for attn in layers:
        attn.attn_logit_softcapping = None
    yield
    for attn in layers:
        attn.attn_logit_softcapping = model.config.attn_logit_softcapping


@contextlib.contextmanager
def _no_sinks(model):
    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # exp(-inf) = 0: the sink takes no mass
    yield
    with torch.no_grad():
        for layer, sinks in zip(model.model.layers, saved):
            layer.self_attn.sinks.copy_(sinks)


def _build(arch):
    """(model in eval mode, the attention its own per-sequence forward uses, the feature switch-off or None)."""
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY)), "sdpa", None
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**TINY)), "sdpa", None
    if arch == "mistral_window":
        return MistralForCausalLM(MistralConfig(**TINY, sliding_window=WINDOW)), "sdpa", _no_window
    if arch == "gemma2_softcap":
        # a soft-cap of 0.5 on logits from large weights (init 0.5) bites hard; layers alternate window / full
        config = Gemma2Config(
            **TINY, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=0.5, initializer_range=0.5
        )
        return Gemma2ForCausalLM(config), "eager", _no_softcap  # sdpa cannot soft-cap: eager is the reference
    if arch == "gpt_oss_sinks":
        config = GptOssConfig(
            **TINY, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)  # sinks start at 0; give them weight
        return model, "eager", _no_sinks
    raise AssertionError(arch)


ARCHS = ["llama", "qwen2", "mistral_window", "gemma2_softcap", "gpt_oss_sinks"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    model, reference_attention, switch_off = _build(request.param)
    model.eval()  # dropout off
    model.set_attn_implementation(reference_attention)
    return model, switch_off


def _sequences(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5, 6), (2, 1), (4, 5)]  # (prompt, response) lengths; total 30
    prompts = [torch.randint(1, VOCAB, (p,), generator=gen) for p, _ in shapes]
    responses = [torch.randint(1, VOCAB, (r,), generator=gen) for _, r in shapes]
    return prompts, responses


def _packed_logits(model, packed):
    reset_call_counts()
    with packed_attention(model, "auto") as name:
        assert name == "sdpa_segments"
        logits = model(**packed_model_inputs(packed)).logits
    assert call_counts() == {"sdpa_segments": NUM_LAYERS}, "the registered backend served every layer"
    return logits


def _own_logits(model, prompt, response):
    before = call_counts()
    logits = model(input_ids=torch.cat([prompt, response]).view(1, -1), use_cache=False).logits[0]
    assert call_counts() == before, "the reference forward runs on the model's own attention"
    return logits


def test_packed_logits_equal_each_sequence_own_forward(arch_model):
    model, switch_off = arch_model
    prompts, responses = _sequences()
    packed = pack_sequences(prompts, responses, pad_to=33)  # 3 padding positions
    with torch.no_grad():
        per_seq = unpack(_packed_logits(model, packed), packed)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            own = _own_logits(model, prompt, response)
            assert (per_seq[i] - own).abs().max() <= 1e-5, f"sequence {i}"
        if switch_off is not None:
            # the feature matters: without it the reference differs, so ignoring it would fail above
            with switch_off(model):
                plain = _own_logits(model, prompts[1], responses[1])
            assert (per_seq[1] - plain).abs().max() > 1e-3


def test_no_leakage_between_sequences(arch_model):
    model, _ = arch_model
    prompts, responses = _sequences()
    changed = list(responses)
    changed[1] = (responses[1] + 7) % VOCAB
    with torch.no_grad():
        before = unpack(_packed_logits(model, pack_sequences(prompts, responses)), pack_sequences(prompts, responses))
        packed = pack_sequences(prompts, changed)
        after = unpack(_packed_logits(model, packed), packed)
    for i in (0, 2, 3):
        if model.config.model_type == "gpt_oss":
            # MoE: the experts' matmuls batch the tokens routed to them, so their shapes (and fp32 rounding, ~1e-8)
            # depend on every token of the row; a leak through attention would be orders of magnitude larger
            assert (before[i] - after[i]).abs().max() <= 1e-6, f"sequence {i} saw sequence 1's tokens"
        else:
            assert torch.equal(before[i], after[i]), f"sequence {i} saw sequence 1's tokens"
    # sequence 1 changed only after its prompt: the prompt's logits stay, the rest moves
    num_prompt = len(prompts[1])
    assert (before[1][:num_prompt] - after[1][:num_prompt]).abs().max() <= 1e-6
    assert (before[1][num_prompt:] - after[1][num_prompt:]).abs().max() > 1e-3


def _summed_token_logprob(logits, labels, mask):
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logprobs * mask).sum()


def test_packed_gradients_equal_per_sequence_gradients(arch_model):
    model, _ = arch_model
    prompts, responses = _sequences(seed=1)
    packed = pack_sequences(prompts, responses, pad_to=31)
    params = [p for p in model.parameters() if p.requires_grad]

    loss = _summed_token_logprob(_packed_logits(model, packed), packed.labels, packed.response_mask)
    packed_grads = torch.autograd.grad(loss, params, allow_unused=True)

    reference = 0.0
    for prompt, response in zip(prompts, responses):
        single = pack_sequences([prompt], [response])
        logits = model(input_ids=single.input_ids, use_cache=False).logits
        reference = reference + _summed_token_logprob(logits, single.labels, single.response_mask)
    assert torch.allclose(loss, reference, rtol=0, atol=1e-4)
    reference_grads = torch.autograd.grad(reference, params, allow_unused=True)
    for p, g, r in zip(params, packed_grads, reference_grads):
        if g is None or r is None:
            assert g is None and r is None
            continue
        assert (g - r).abs().max() <= 1e-5 * max(1.0, r.abs().max().item())


def test_empty_pack_runs_through_the_model():
    model, _, _ = _build("llama")
    packed = pack_sequences([], [])
    logits = _packed_logits(model, packed)
    assert logits.shape == (1, 1, VOCAB)
    loss = _summed_token_logprob(logits, packed.labels, packed.response_mask)
    loss.backward()
    assert loss.item() == 0.0


def test_a_packed_row_on_plain_sdpa_with_a_cache_leaks():
    """Control: why the tests assert the backend ran. Passing the packed row to sdpa with the default use_cache
    (a cache is created, so transformers skips its packed-sequence detection) attends across sequences."""
    model, _, _ = _build("llama")
    prompts, responses = _sequences()
    packed = pack_sequences(prompts, responses)
    with torch.no_grad():
        leaky = unpack(model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits, packed)
        own = _own_logits(model, prompts[1], responses[1])
    assert (leaky[1] - own).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------------------
# Generation stays on sdpa
# --------------------------------------------------------------------------------------------------------------


def _left_padded_prompts():
    prompts = [[5, 9, 13], [7, 3, 11, 2, 8, 6], [4]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, attention_mask


def _greedy(model, input_ids, attention_mask):
    return model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0
    )


def test_generation_unchanged_after_a_packed_training_forward():
    model, _, _ = _build("llama")
    model.eval()
    input_ids, attention_mask = _left_padded_prompts()
    with torch.no_grad():
        before = _greedy(model, input_ids, attention_mask)

    model.train()
    prompts, responses = _sequences()
    packed = pack_sequences(prompts, responses)
    loss = _summed_token_logprob(_packed_logits(model, packed), packed.labels, packed.response_mask)
    loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()

    assert model.config._attn_implementation == "sdpa", "the packed backend was switched back"
    reset_call_counts()
    with torch.no_grad(), generation_attention(model, "sdpa"):
        after = _greedy(model, input_ids, attention_mask)
    assert call_counts() == {}, "generation never ran the packed backend"
    assert torch.equal(before, after)
    assert after.shape == (3, 6 + 6)


def test_generation_on_the_packed_backend_is_refused():
    model, _, _ = _build("llama")
    model.eval()
    input_ids, attention_mask = _left_padded_prompts()
    with torch.no_grad(), packed_attention(model, "sdpa_segments"):
        with pytest.raises(ValueError, match="take no padding mask"):
            _greedy(model, input_ids, attention_mask)  # left-padded rows
        with pytest.raises(ValueError, match="take no padding mask"):
            model(input_ids=input_ids[:1], attention_mask=attention_mask[:1], use_cache=False)  # one padded row
        with pytest.raises(ValueError, match="one packed row"):
            model(input_ids=input_ids, use_cache=False)  # a batch without a mask
        # an all-ones mask hides nothing: accepted
        model(input_ids=input_ids[1:2], attention_mask=attention_mask[1:2], use_cache=False)
        with pytest.raises(ValueError, match="training forwards only"):
            _greedy(model, input_ids[1:2], attention_mask[1:2])  # no padding: the first decoding step
    assert model.config._attn_implementation == "sdpa", "restored after the error too"


def test_switching_keeps_the_models_own_attention_and_checks_the_model():
    model, _, _ = _build("gemma2_softcap")  # transformers refuses names containing "sdpa" for Gemma2
    model.set_attn_implementation("eager")
    with packed_attention(model) as name:
        assert model.config._attn_implementation == name == "sdpa_segments"
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="expected a transformers PreTrainedModel"):
        set_attention(torch.nn.Linear(2, 2), "sdpa_segments")
