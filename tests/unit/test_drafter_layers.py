"""A drafter of more than one decoder layer (`drafter.num_layers`): packed == the per-sequence oracle, the forward ==
vLLM's layer stack written out by hand, and the export names and reloads the later layers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fsdptrain.check.draft_per_sequence import per_sequence_draft_loss
from fsdptrain.model.drafter import Eagle3Drafter, build_draft_vocab
from fsdptrain.model.drafter_export import export_drafter, load_drafter
from fsdptrain.metrics.typed import finalize, merge_all
from tests.unit.test_drafter import (
    PACKS,
    PROMPTS,
    RESPONSES,
    TEMPERATURE,
    VOCAB,
    _draft_norms,
    _grads,
    _packed_draft_loss,
    _policy,
    drafter_logits,
)


def _two_layer_drafter(policy, num_layers: int = 2) -> Eagle3Drafter:
    vocab = build_draft_vocab([p + r for p, r in zip(PROMPTS, RESPONSES)], vocab_size=VOCAB, draft_vocab_size=12)
    torch.manual_seed(1)
    drafter = Eagle3Drafter.from_policy(policy, vocab, feature_layers=(0, 2, 3), num_layers=num_layers)
    with torch.no_grad():  # perturb the warm-started head and the unit norms, so every weight matters
        drafter.lm_head.weight.add_(0.3 * torch.randn_like(drafter.lm_head.weight))
        for name, param in drafter.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    return drafter


@pytest.mark.parametrize("arch,mode", [("llama", "token-mean"), ("llama", "seq-mean-token-mean"),
                                       ("qwen2", "seq-mean-token-sum")])
def test_two_layer_packed_draft_loss_equals_per_sequence_reference(arch, mode):
    policy = _policy(arch)
    drafter = _two_layer_drafter(policy)
    assert set(drafter.layers) == {"1"}
    norms = _draft_norms("response")

    drafter.zero_grad()
    ref_loss, ref_metrics = per_sequence_draft_loss(policy, drafter, PROMPTS, RESPONSES, norms=norms, agg_mode=mode,
                                                    on="response", temperature=TEMPERATURE)
    ref_loss.backward()
    ref_grads = _grads(drafter)

    drafter.zero_grad()
    total, collected = 0.0, []
    for pack in PACKS:
        loss, metrics = _packed_draft_loss(policy, drafter, pack, norms=norms, mode=mode, on="response")
        loss.backward()
        total += loss.item()
        collected.append(metrics)
    assert total == pytest.approx(ref_loss.item(), rel=1e-6)
    got, want = finalize(merge_all(collected)), finalize(ref_metrics)
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    got_grads = _grads(drafter)
    assert set(got_grads) == set(ref_grads)
    assert "layers.1.self_attn.q_proj.weight" in got_grads and "layers.1.mlp.down_proj.weight" in got_grads
    assert ref_grads["layers.1.self_attn.q_proj.weight"].abs().max() > 0  # the second layer's attention trains
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for name in ref_grads:
        assert (got_grads[name] - ref_grads[name]).abs().max().item() <= 1e-6 * scale, name


def test_two_layer_forward_is_vllms_layer_stack_by_hand():
    """vLLM's Eagle3 LlamaModel: layer 0 returns (mlp_out, residual); a later layer's fused input norm adds them
    (residual = h + residual, h = norm(residual)), attention, the fused post-attention norm, the MLP; the final
    fused norm takes h + residual."""
    policy = _policy("llama")
    drafter = _two_layer_drafter(policy)
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(7, 3 * 32, generator=gen)
    embeds = torch.randn(7, 32, generator=gen)
    positions = torch.arange(7)[None]
    with torch.no_grad(), drafter.attention("sdpa"):
        got = drafter(features, embeds, position_ids=positions)
        fused = drafter.fc(features)[None]
        rope = drafter.rotary_emb(fused, positions)
        h, residual = drafter.midlayer(embeds[None], fused, rope, position_ids=positions)
        layer = drafter.layers["1"]
        residual = h + residual
        h, _ = layer.self_attn(layer.input_layernorm(residual), position_embeddings=rope, attention_mask=None,
                               position_ids=positions)
        residual = h + residual
        h = layer.mlp(layer.post_attention_layernorm(residual))
        want = drafter.norm(h + residual)[0]
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    one = _two_layer_drafter(policy, num_layers=1)
    with torch.no_grad(), one.attention("sdpa"):
        assert not torch.allclose(one(features, embeds, position_ids=positions), got, atol=1e-3)


def test_two_layer_export_names_and_reloads(tmp_path):
    policy = _policy("llama")
    drafter = _two_layer_drafter(policy)
    export_drafter(drafter, tmp_path / "eagle3", policy.config)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    with safe_open(str(tmp_path / "eagle3" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # vLLM renames midlayer.* to layers.0.* and loads layers.1.* as they are
    assert {"midlayer.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight", "layers.1.input_layernorm.weight",
            "layers.1.post_attention_layernorm.weight", "layers.1.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith("layers.0.") for n in names)
    loaded = load_drafter(tmp_path / "eagle3")
    assert loaded.config.num_hidden_layers == 2
    outs = drafter_logits(policy, (drafter, loaded))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_the_run_builds_the_configured_number_of_layers_whatever_the_policy_has(num_layers):
    """`drafter.num_layers` alone sets the drafter's depth (the policy here has 4 decoder layers)."""
    from fsdptrain.train.drafter_setup import plain_drafter

    policy = _policy("llama")
    vocab = build_draft_vocab([p + r for p, r in zip(PROMPTS, RESPONSES)], vocab_size=VOCAB, draft_vocab_size=12)
    drafter = plain_drafter(policy, vocab, feature_layers=None, init_head_from_policy=True, seed=0,
                            num_layers=num_layers)
    assert drafter.config.num_hidden_layers == num_layers
    assert sorted(drafter.layers) == [str(i) for i in range(1, num_layers)]
