"""Shared prompts (fsdptrain/data/shared_prompts.py): the model row laid out by hand, and a shared-prompt forward equal to
the unshared one (log-probs, entropy, values, losses, metrics, gradients; fp32, 1e-6) on tiny Llama and Qwen2 models,
on `sdpa_segments` and on the `flash_attn` backend's code with the CPU stand-in kernel
(tests/helpers/varlen_kernel_standins.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from fsdptrain.config.compose import compose_config
from fsdptrain.config import ConfigError
from fsdptrain.data.packing import PackPlan, pack_sequences
from fsdptrain.data.shared_prompts import expand_units, pack_shared_prompts, shared_prompt_units
from fsdptrain.model import attention_backends
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.forward import final_hidden_states
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.metrics.typed import finalize
from fsdptrain.rl.fused_loss import SeqTargets, ValueLossSettings
from fsdptrain.rl.pg_terms import PolicyLossSettings
from fsdptrain.train.pack_losses import packed_policy_loss, packed_value_loss, policy_token_outputs
from tests.helpers.attention_call_counts import call_counts, reset_call_counts
from tests.helpers.varlen_kernel_standins import cpu_kernel, make_flash_attn_varlen_func

# two groups of three (one with a tool segment masked out, one with an empty response), a group of one
PROMPTS = [[1, 5, 9], [1, 7], [1, 5, 9], [1, 7], [1, 5, 9], [1, 7], [2, 3]]
RESPONSES = [[4, 4, 6, 2], [10, 13, 2], [9, 2], [3], [8, 8, 8, 8, 1], [], [5, 6, 7]]
MASKS = [None, None, None, None, [1, 1, 0, 0, 1], None, None]
TINY = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def test_model_row_holds_each_prompt_once():
    prompts, responses = [[1, 5, 9], [1, 7], [1, 5, 9], [1, 5, 9]], [[4, 6], [3], [], [8]]
    packed = pack_shared_prompts(prompts, responses)
    row = packed.model_row
    # group [1,5,9]: prompt at 0..2, responses at 3..4 and 5 (the empty one has no tokens); group [1,7] at 6..8
    assert row.input_ids.tolist() == [[1, 5, 9, 4, 6, 8, 1, 7, 3]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    assert row.cu_seqlens.tolist() == [0, 6, 9]
    # the loss row is pack_sequences' own; each of its positions reads the model row at the same token in context
    unshared = pack_sequences(prompts, responses)
    assert torch.equal(packed.input_ids, unshared.input_ids) and torch.equal(packed.response_mask,
                                                                            unshared.response_mask)
    assert row.source_T.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 0, 1, 2, 0, 1, 2, 5]
    assert torch.equal(row.input_ids[0, row.source_T], packed.input_ids[0])
    branches = row.branches
    assert branches.masks[0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                                [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    assert branches.masks[1] is None  # one response: plain causal
    # varlen entries: prompt [0,3), response [3,5) with keys 0,1,2,3,4; response [5,6) with keys 0,1,2,5; ...
    assert branches.cu_q.tolist() == [0, 3, 5, 6, 8, 9]
    assert branches.cu_k.tolist() == [0, 3, 8, 12, 14, 17]
    assert branches.kv_index_K.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 6, 7, 8]
    assert (branches.max_q, branches.max_k) == (3, 5)


def test_units_keep_a_prompt_together_under_the_budget():
    prompts, responses = [[1, 2], [3], [1, 2], [1, 2]], [[5, 5, 5], [6], [7, 7], [8, 8, 8]]
    # budget 8: prompt [1,2] + 3 + 2 = 7 fits, + 3 more would be 10: cut; the cut unit repeats the prompt
    units, sizes = shared_prompt_units(prompts, responses, 8)
    assert units == [[0, 2], [3], [1]] and sizes == [7, 5, 2]
    plan = expand_units(PackPlan([[0, 2], [1]], [9, 5], [9 / 10, 5 / 10], 10), units)
    assert plan.packs == [[0, 1, 2], [3]]


def _models(arch: str):
    torch.manual_seed(0)
    if arch == "qwen2":
        policy = Qwen2ForCausalLM(Qwen2Config(**TINY))
    else:
        policy = LlamaForCausalLM(LlamaConfig(**TINY))
    critic = LlamaForTokenClassification(LlamaConfig(**TINY, num_labels=1))
    critic.eval()  # the token-classification head's dropout
    return policy.float(), critic.float()


def _targets() -> list[SeqTargets]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for r, m in zip(RESPONSES, MASKS):
        n = len(r)
        out.append(SeqTargets(old_logprobs=-1.0 - torch.rand(n, generator=gen), advantages=torch.randn(n, generator=gen),
                              ref_logprobs=-1.0 - torch.rand(n, generator=gen), old_values=torch.randn(n, generator=gen),
                              returns=torch.randn(n, generator=gen),
                              response_mask=None if m is None else torch.tensor(m, dtype=torch.bool)))
    return out


def _run(model, loss_fn, settings, pack_fn, packs, norms, targets):
    """Losses, finalised metrics and gradients of the packs, as accumulate_gradients runs them."""
    model.zero_grad()
    total, merged = 0.0, None
    masks = [t.response_mask for t in targets]
    for pack in packs:
        packed = pack_fn(PROMPTS, RESPONSES, pack, response_masks=masks)
        loss, metrics = loss_fn(model, packed, [targets[i] for i in pack], norms=norms, settings=settings)
        loss.backward()
        total += loss.item()
        merged = metrics if merged is None else merged.merge(metrics)
    return total, finalize(merged), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=1e-7)
    assert set(got[1]) == set(want[1])
    for name in want[1]:
        assert got[1][name] == pytest.approx(want[1][name], rel=1e-6, abs=1e-6), name
    scale = max(g.abs().max().item() for g in want[2].values())
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        assert (got[2][name] - want[2][name]).abs().max().item() <= 1e-6 * scale, name


@pytest.mark.parametrize(("arch", "backend"), [
    ("llama", "sdpa_segments"),
    pytest.param("qwen2", "sdpa_segments", marks=pytest.mark.slow),  # CI budget: Llama covers the shared row
    ("llama", "flash_attn")])
def test_shared_prompt_losses_equal_the_unshared(arch, backend, monkeypatch):
    """`flash_attn` runs the backend's own code on the documented CPU stand-in kernel."""
    if backend == "flash_attn":
        kernel = cpu_kernel(make_flash_attn_varlen_func())
        monkeypatch.setattr(attention_backends, "flash_kernel", lambda: kernel)
    policy, critic = _models(arch)
    targets = _targets()
    counted = sum(len(r) if m is None else sum(m) for r, m in zip(RESPONSES, MASKS))
    norms = LossNormalizers(global_num_tokens=counted, global_num_seqs=6, dp_size=1, loss_scale_factor=None)
    policy_settings = PolicyLossSettings(agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                                         clip_ratio_c=3.0, seq_level_ratio=False, kl_coef=0.1, kl_estimator="k3",
                                         entropy_coef=0.01, temperature=0.7, chunk_size=5, use_reference=True)
    value_settings = ValueLossSettings(agg_mode="token-mean", cliprange_value=0.2)
    packs = [[0, 1, 2, 3], [4, 5, 6]]  # the first group split over two packs

    # the unshared reference on sdpa_segments (the stand-in's float64 sums would differ in the last bits)
    set_attention(policy, "sdpa_segments")
    set_attention(critic, "sdpa_segments")
    want_policy = _run(policy, packed_policy_loss, policy_settings, pack_sequences, packs, norms, targets)
    with_critic = (arch, backend) == ("llama", "sdpa_segments")  # the critic's forward once (CI time)
    if with_critic:
        want_value = _run(critic, packed_value_loss, value_settings, pack_sequences, packs, norms, targets)
    set_attention(policy, backend)
    set_attention(critic, backend)
    reset_call_counts()
    got_policy = _run(policy, packed_policy_loss, policy_settings, pack_shared_prompts, packs, norms, targets)
    assert call_counts()[backend] > 0, "the backend under test did not run"
    _assert_same(got_policy, want_policy)
    if with_critic:
        _assert_same(_run(critic, packed_value_loss, value_settings, pack_shared_prompts, packs, norms, targets),
                     want_value)

    # the log-probs and entropy per position, including the first response token read at the shared prompt end
    shared, unshared = pack_shared_prompts(PROMPTS, RESPONSES), pack_sequences(PROMPTS, RESPONSES)
    with torch.no_grad():
        got = policy_token_outputs(policy, shared, temperature=0.7, chunk_size=5)
        set_attention(policy, "sdpa_segments")
        want = policy_token_outputs(policy, unshared, temperature=0.7, chunk_size=5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_shared_prompts_see_no_other_response():
    """Negative control: a mask that lets a response see its group's other responses changes the hidden states."""
    policy, _ = _models("llama")
    set_attention(policy, "sdpa_segments")
    shared = pack_shared_prompts(PROMPTS, RESPONSES)
    with torch.no_grad():
        want = final_hidden_states(policy, pack_sequences(PROMPTS, RESPONSES))
        got = final_hidden_states(policy, _leaky(shared))
    assert (got - want).abs().max() > 1e-3


def _leaky(shared):
    """The shared row with its per-group masks dropped: plain causal attention over each group, so a response sees
    the responses before it (the bug the masks prevent)."""
    row = shared.model_row
    leaky = dict(row.branches.__dict__, masks=tuple(None for _ in row.branches.masks))
    leaky_row = type(row)(**dict(row.__dict__, branches=type(row.branches)(**leaky)))
    return type(shared)(**dict(shared.__dict__, model_row=leaky_row))


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["trainer.share_prompts=true", "model.attn_backend=torch_varlen"], "trainer.share_prompts=true needs keys"),
    (["trainer.share_prompts=true", "drafter.enabled=true"], "trainer.share_prompts=true is not supported with drafter"),
])
def test_what_shared_prompts_cannot_do_is_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        compose_config(overrides)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or attention_backends.flash_kernel() is None,
                    reason="needs CUDA and flash_attn")
def test_flash_attn_shared_prompts_on_the_gpu():
    policy, _ = _models("llama")
    policy = policy.to("cuda", torch.bfloat16)
    set_attention(policy, "flash_attn")
    with torch.no_grad():
        got = final_hidden_states(policy, pack_shared_prompts(PROMPTS, RESPONSES).to("cuda")).float()
        want = final_hidden_states(policy, pack_sequences(PROMPTS, RESPONSES).to("cuda")).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _token_outputs(policy, pack_fn):
    with torch.no_grad():
        packed = pack_fn(PROMPTS, RESPONSES) if callable(pack_fn) else pack_fn
        return policy_token_outputs(policy, packed, temperature=0.7, chunk_size=5)


def test_shared_prompts_in_bf16_match_the_unshared():
    """parallel.param_dtype=bfloat16 runs the layers on bf16 weights. The shared row's masked attention in bf16 gives
    the unshared log-probs and entropy within 1e-2 (measured: equal); the leaky row (responses seeing each other)
    is 0.08 off in the log-probs on the same bf16 model, so the tolerance separates right from wrong."""
    policy, _ = _models("llama")
    policy = policy.to(torch.bfloat16)
    set_attention(policy, "sdpa_segments")
    want = _token_outputs(policy, pack_sequences)
    got = _token_outputs(policy, pack_shared_prompts)
    assert got[0].dtype == torch.float32  # log-probs are computed in fp32 from the bf16 hidden states
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-2)
    leaky = _token_outputs(policy, _leaky(pack_shared_prompts(PROMPTS, RESPONSES)))
    assert (leaky[0] - want[0]).abs().max() > 1e-2


def test_shared_prompts_under_compiled_layers_equal_the_eager_ones():
    """parallel.compile compiles each decoder layer (fsdptrain/distributed/fsdp.py `apply_compile`); the shared row's
    attention call traces through it (eager backend: no codegen, so the numbers are the eager ones)."""
    from torch._dynamo.utils import counters

    from fsdptrain.distributed.fsdp import apply_compile

    policy, _ = _models("llama")
    set_attention(policy, "sdpa_segments")
    want = _token_outputs(policy, pack_shared_prompts)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(policy, backend="eager")
    try:
        got = _token_outputs(policy, pack_shared_prompts)
        assert counters["stats"]["unique_graphs"] > 0, "the layers did not run compiled"
    finally:
        torch._dynamo.reset()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("overrides", "backend", "model_config", "want"), [
    ([], "sdpa_segments", LlamaConfig(**TINY), (True, "auto: the backend, the model and the features in use allow it")),
    ([], "flash_attn", LlamaConfig(**TINY), (True, "auto: the backend, the model and the features in use allow it")),
    ([], "torch_varlen", LlamaConfig(**TINY),
     (False, "auto: the packed attention backend torch_varlen takes no keys apart from queries")),
    (["drafter.enabled=true"], "sdpa_segments", LlamaConfig(**TINY),
     (False, "auto: drafter.enabled=true reads the unshared packed row")),
    (["rollout.n=1"], "sdpa_segments", LlamaConfig(**TINY), (False, "auto: rollout.n=1: no prompt repeats in a pack")),
    (["parallel.cp=2"], "sdpa_segments", LlamaConfig(**TINY),
     (False, "auto: parallel.cp=2 splits the packed rows over a context-parallel group")),
    ([], "sdpa_segments", MistralConfig(sliding_window=8),
     (False, "auto: the model (mistral) has sliding-window attention")),
    ([], "sdpa_segments", Qwen2Config(use_sliding_window=False),
     (True, "auto: the backend, the model and the features in use allow it")),
    ([], "sdpa_segments", Gemma2Config(), (False, "auto: the model (gemma2) has sliding-window attention")),
    ([], "sdpa_segments", Gemma2Config(sliding_window=None, layer_types=["full_attention"] * 26),
     (False, "auto: the model (gemma2) soft-caps its attention logits")),
    (["trainer.share_prompts=true"], "sdpa_segments", LlamaConfig(**TINY), (True, "trainer.share_prompts=true")),
    (["trainer.share_prompts=false"], "sdpa_segments", LlamaConfig(**TINY), (False, "trainer.share_prompts=false")),
])
def test_share_prompts_auto_is_on_wherever_the_backend_model_and_features_allow(overrides, backend, model_config, want):
    """trainer.share_prompts=auto (the default) resolves to on, or off naming why; true and false stay as set (Hydra's
    bool `=true` included)."""
    from fsdptrain.train.setup import resolve_share_prompts

    cfg = compose_config(overrides)
    assert resolve_share_prompts(cfg, backend, model_config) == want
