"""The co-trained EAGLE-3 drafter: packed draft loss == the per-sequence oracle (value, drafter gradients, metrics),
the policy's gradients untouched, the shift's mask worked out by hand, the vocabulary, and the export round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fsdptrain.check.draft_per_sequence import per_sequence_draft_loss
from fsdptrain.data.packing import pack_sequences
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.drafter import (
    DraftVocab,
    Eagle3Drafter,
    build_draft_vocab,
    capture_policy_features,
    default_feature_layers,
    load_draft_vocab,
    run_drafter,
    save_draft_vocab,
    teacher_head_rows,
)
from fsdptrain.model.drafter_export import ARCHITECTURE, export_drafter, load_drafter
from fsdptrain.registry.names import AGG_MODES
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.draft_loss import draft_loss, draft_mask, expected_accept_len
from fsdptrain.metrics.typed import finalize, merge_all
from fsdptrain.rl.policy_loss import policy_loss
from fsdptrain.rl.draft_loss import count_draft_tokens_and_seqs, packed_draft_mask
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets, scatter_responses, token_logprobs_entropy
from fsdptrain.train.pack_losses import packed_policy_loss
from tests.helpers.attention_call_counts import call_counts, reset_call_counts

VOCAB = 32
# the fourth and sixth sequences are shorter than the shift (lengths 2 and 1), the fifth has a one-token response
PROMPTS = [[1, 5, 9], [1, 7], [1, 3, 3, 8, 2], [1], [1, 11, 12], [2]]
RESPONSES = [[4, 4, 6, 2], [9, 2, 17, 21], [10, 13, 2], [5], [3], []]
PACKS = [[0, 3, 5], [1, 2, 4], []]  # uneven micro-batches and an empty pack
TEMPERATURE = 0.7


def _policy(arch: str):
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    set_attention(model, "sdpa_segments")
    return model.float()


def _drafter(policy, draft_vocab_size: int = 12) -> Eagle3Drafter:
    vocab = build_draft_vocab([p + r for p, r in zip(PROMPTS, RESPONSES)], vocab_size=VOCAB,
                              draft_vocab_size=draft_vocab_size)
    torch.manual_seed(1)
    drafter = Eagle3Drafter.from_policy(policy, vocab, feature_layers=(0, 2, 3))
    with torch.no_grad():  # the warm start is exact; perturb the head so q != p and the loss has a gradient
        drafter.lm_head.weight.add_(0.3 * torch.randn_like(drafter.lm_head.weight))
    return drafter


def _draft_norms(on: str) -> LossNormalizers:
    counts = [count_draft_tokens_and_seqs(pack_sequences(PROMPTS, RESPONSES, pack), on=on) for pack in PACKS]
    return LossNormalizers(global_num_tokens=sum(c[0] for c in counts), global_num_seqs=sum(c[1] for c in counts),
                           dp_size=1, loss_scale_factor=8.0)


def _packed_draft_loss(policy, drafter, pack, *, norms, mode, on, chunk_size=3):
    packed = pack_sequences(PROMPTS, RESPONSES, pack)
    features = capture_policy_features(policy, packed, feature_layers=drafter.feature_layers)
    with drafter.attention("sdpa_segments"):
        hidden = run_drafter(drafter, features, packed)
    rows, bias = teacher_head_rows(policy, drafter)
    return draft_loss(hidden, drafter.lm_head.weight, features.final_hidden_TH, rows,
                      packed_draft_mask(packed, on=on), norms=norms, agg_mode=mode, cu_seqlens=packed.cu_seqlens,
                      temperature=TEMPERATURE, chunk_size=chunk_size, teacher_bias_D=bias)


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


# every mode on both architectures with the response mask; the 'all' mask on Llama in every mode, on Qwen2 once
CASES = ([(arch, mode, "response") for arch in ("llama", "qwen2") for mode in AGG_MODES]
         + [("llama", mode, "all") for mode in AGG_MODES] + [("qwen2", "token-mean", "all")])


@pytest.mark.parametrize("arch,mode,on", CASES)
def test_packed_draft_loss_equals_per_sequence_reference(arch, mode, on):
    policy = _policy(arch)
    drafter = _drafter(policy)
    norms = _draft_norms(on)

    drafter.zero_grad()
    ref_loss, ref_metrics = per_sequence_draft_loss(policy, drafter, PROMPTS, RESPONSES, norms=norms, agg_mode=mode,
                                                    on=on, temperature=TEMPERATURE)
    ref_loss.backward()
    ref_grads = _grads(drafter)
    assert not _grads(policy), "the draft loss reached the policy"

    drafter.zero_grad()
    reset_call_counts()
    total, collected = 0.0, []
    for pack in PACKS:
        loss, metrics = _packed_draft_loss(policy, drafter, pack, norms=norms, mode=mode, on=on)
        loss.backward()
        total += loss.item()
        collected.append(metrics)
    assert call_counts()["sdpa_segments"] > 0
    assert not _grads(policy), "the draft loss reached the policy"
    assert total == pytest.approx(ref_loss.item(), rel=1e-6)
    got, want = finalize(merge_all(collected)), finalize(ref_metrics)
    assert set(got) == set(want) == {"drafter/loss", "drafter/top1_agreement", "drafter/accept_prob",
                                     "drafter/expected_accept_len@3"}
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    got_grads = _grads(drafter)
    assert set(got_grads) == set(ref_grads) and "fc.weight" in got_grads and "lm_head.weight" in got_grads
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert scale > 0
    for name in ref_grads:
        assert (got_grads[name] - ref_grads[name]).abs().max().item() <= 1e-6 * scale, name


def test_empty_pack_gives_zero_loss_and_the_same_metric_names():
    policy = _policy("llama")
    drafter = _drafter(policy)
    norms = _draft_norms("response")
    loss, metrics = _packed_draft_loss(policy, drafter, [], norms=norms, mode="token-mean", on="response")
    loss.backward()
    assert loss.item() == 0.0
    _, full = _packed_draft_loss(policy, drafter, [0, 1], norms=norms, mode="token-mean", on="response")
    assert set(metrics) == set(full)
    assert finalize(metrics) == {"drafter/loss": 0.0}  # empty means are absent, never 0.0


def test_policy_gradients_are_bit_identical_with_the_draft_loss_added():
    """The combined step (one capture forward, the policy loss, plus the draft loss) leaves the policy's
    gradients exactly those of `packed_policy_loss` alone."""
    policy = _policy("llama")
    drafter = _drafter(policy)
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                  seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.01,
                                  temperature=TEMPERATURE, chunk_size=4)
    gen = torch.Generator().manual_seed(2)
    targets = [SeqTargets(old_logprobs=-torch.rand(len(r), generator=gen),
                          advantages=torch.randn(len(r), generator=gen)) for r in RESPONSES]
    norms = LossNormalizers(global_num_tokens=sum(map(len, RESPONSES)), global_num_seqs=len(RESPONSES))
    draft_norms = _draft_norms("response")
    pack = [1, 2, 4]
    packed = pack_sequences(PROMPTS, RESPONSES, pack)

    policy.zero_grad()
    alone, _ = packed_policy_loss(policy, packed, [targets[i] for i in pack], norms=norms, settings=settings)
    alone.backward()
    want = _grads(policy)

    policy.zero_grad()
    features = capture_policy_features(policy, packed, feature_layers=drafter.feature_layers)
    head = policy.get_output_embeddings()
    logprobs, entropy = token_logprobs_entropy(features.final_hidden_TH, head.weight, head.bias, packed,
                                               temperature=TEMPERATURE, chunk_size=4)
    pg, _ = policy_loss(logprobs, scatter_responses([targets[i].old_logprobs for i in pack], packed),
                        scatter_responses([targets[i].advantages for i in pack], packed), packed.response_mask[0],
                        norms=norms,
                        settings=PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                                                    clip_ratio_c=3.0, entropy_coef=0.01),
                        cu_seqlens=packed.cu_seqlens, entropy=entropy)
    with drafter.attention("sdpa_segments"):
        hidden = run_drafter(drafter, features, packed)
    rows, bias = teacher_head_rows(policy, drafter)
    dl, _ = draft_loss(hidden, drafter.lm_head.weight, features.final_hidden_TH, rows,
                       packed_draft_mask(packed, on="response"), norms=draft_norms, agg_mode="token-mean",
                       cu_seqlens=packed.cu_seqlens, temperature=TEMPERATURE, chunk_size=3, teacher_bias_D=bias)
    assert torch.equal(pg, alone)
    (pg + 0.5 * dl).backward()
    got = _grads(policy)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_draft_mask_of_two_packed_segments_by_hand():
    # segment A: prompt [1, 5], response [7, 8, 9] (positions 0..4); segment B: prompt [1], response [4, 6]
    # (positions 5..7); a tail of 2 (positions 8, 9).
    packed = pack_sequences([[1, 5], [1]], [[7, 8, 9], [4, 6]], pad_to=10)
    # position t is scored when t+2 is in t's segment (and, for 'response', a response token):
    # A: t=0 -> token 2 (response), t=1 -> 3, t=2 -> 4; t=3, 4 have no t+2 in A.  B: t=5 -> 7; t=6, 7 do not.
    assert packed_draft_mask(packed, on="response").tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    assert packed_draft_mask(packed, on="all").tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    packed = pack_sequences([[1, 5, 6, 2], [3]], [[7, 8], [4]])
    # A: tokens 0..5, response tokens 4, 5 -> scored at t = 2, 3 ('all': 0..3); B: length 2, nothing.
    assert packed_draft_mask(packed, on="response").tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert packed_draft_mask(packed, on="all").tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert count_draft_tokens_and_seqs(packed, on="response") == (2, 1)
    with pytest.raises(ValueError, match="drafter.on"):
        draft_mask(packed.label_mask, packed.response_mask, on="prompt")


def test_expected_accept_len_by_hand():
    a = torch.tensor([0.5, 0.8, 0.4, 0.9, 0.3])
    mask = torch.tensor([True, True, True, True, False])
    length, full = expected_accept_len(a, mask)
    assert full.tolist() == [True, True, False, False, False]
    assert length[0].item() == pytest.approx(0.5 + 0.5 * 0.8 + 0.5 * 0.8 * 0.4, rel=1e-7)
    assert length[1].item() == pytest.approx(0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.9, rel=1e-7)


def test_draft_vocab_offsets_follow_the_engines():
    vocab = build_draft_vocab([[5, 5, 9, 2], [9, 5, 30]], vocab_size=VOCAB, draft_vocab_size=4)
    assert vocab.draft_to_target.tolist() == [2, 5, 9, 30]  # 5 (x3), 9 (x2), then ties 2 < 30
    assert vocab.d2t.tolist() == [2, 4, 7, 27]  # target - draft index, added to arange(D) by vLLM and SGLang
    assert vocab.t2d.sum().item() == 4 and vocab.t2d[[2, 5, 9, 30]].all()
    padded = build_draft_vocab([[7]], vocab_size=VOCAB, draft_vocab_size=3)
    assert padded.draft_to_target.tolist() == [0, 1, 7]


def test_draft_vocab_file_round_trip(tmp_path):
    vocab = DraftVocab.from_target_ids([3, 1, 20], VOCAB)
    save_draft_vocab(vocab, tmp_path / "vocab.json")
    again = load_draft_vocab(tmp_path / "vocab.json", vocab_size=VOCAB)
    assert torch.equal(again.d2t, vocab.d2t) and torch.equal(again.t2d, vocab.t2d)
    with pytest.raises(ValueError, match="rebuild"):
        load_draft_vocab(tmp_path / "vocab.json", vocab_size=64)


def test_default_feature_layers_follow_vllm():
    assert default_feature_layers(32) == (2, 16, 29)
    assert default_feature_layers(2) == (1, 1, 0)


def drafter_logits(policy, drafters) -> list[torch.Tensor]:
    """Each drafter's logits (sdpa_segments, no grad) on one packed batch of PROMPTS / RESPONSES and the policy's
    features at the first drafter's layers: what an exported and reloaded drafter must reproduce."""
    packed = pack_sequences(PROMPTS, RESPONSES, [1, 2, 4])
    features = capture_policy_features(policy, packed, feature_layers=drafters[0].feature_layers)
    with torch.no_grad():
        outs = []
        for model in drafters:
            with model.attention("sdpa_segments"):
                outs.append(model.compute_logits(run_drafter(model, features, packed)))
    return outs


def test_export_round_trip_reproduces_the_logits(tmp_path):
    policy = _policy("qwen2")
    drafter = _drafter(policy)
    export_drafter(drafter, tmp_path / "eagle3", policy.config)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert config["draft_vocab_size"] == 12 and config["vocab_size"] == VOCAB
    assert config["target_hidden_size"] == 32 and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["rope_theta"] == 1e6 and config["tie_word_embeddings"] is False
    from safetensors import safe_open
    with safe_open(str(tmp_path / "eagle3" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert not any(n.startswith("model.") or "rotary" in n for n in names)

    loaded = load_drafter(tmp_path / "eagle3")
    assert loaded.feature_layers == drafter.feature_layers
    outs = drafter_logits(policy, (drafter, loaded))
    assert torch.equal(outs[0], outs[1])
    assert math.isfinite(outs[0].sum().item())


def test_the_drafter_predicts_the_policy_tokens_only():
    # prompt [1, 2] + response [3, 4, 5, 6], a tool wrote 4 and 5: position t predicts token t+2, scored when that
    # is a policy token (3 at t=0, 6 at t=3); the reference's mask, built from the definition, agrees
    from fsdptrain.check.draft_per_sequence import sequence_draft_mask

    packed = pack_sequences([[1, 2]], [[3, 4, 5, 6]], response_masks=[[1, 0, 0, 1]])
    want = [True, False, False, True, False, False]
    assert packed_draft_mask(packed, on="response").tolist() == want
    assert sequence_draft_mask(2, 6, "response", [1, 0, 0, 1]).tolist() == want
    assert count_draft_tokens_and_seqs(packed, on="response") == (2, 1)
