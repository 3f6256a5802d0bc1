"""The load-balancing loss through the product's update (fsdptrain/train/step.py, train/pack_losses.py) on a real
tiny Qwen3-MoE in float64, one process: its value (the ``moe/aux_loss`` metric) and its gradient equal transformers'
own ``aux_loss`` of the whole mini-batch as ONE padded forward with an attention mask, whatever the packs; the
expert-load metrics are those of the whole mini-batch's routes. A planted per-micro-batch value fails it."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from fsdptrain.check.precision import Float64Mode
from fsdptrain.data.packing import plan_packs
from fsdptrain.metrics.typed import finalize
from fsdptrain.model.attention_switch import set_attention
from fsdptrain.model.loading import without_router_loss
from fsdptrain.model.moe import routing
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.moe_aux_loss import local_expert_counts, whole_batch_aux_loss
from fsdptrain.train import pack_losses, step
from fsdptrain.train.pack_losses import DemoTarget, SftLossSettings, packed_sft_loss
from fsdptrain.train.step import MiniBatch

PROMPTS = [[1, 5, 9], [1, 7], [3, 4, 5, 6, 7]]
RESPONSES = [[4, 4, 6, 2], [9, 2, 17], [8, 8]]
COEF = 0.5


def tiny_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=COEF)).double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


def transformers_reference(model) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' aux_loss of the whole batch in one right-padded forward, and the gradient of the same loss in
    float64 (`whole_batch_aux_loss` of that forward's router logits and mask: transformers sums in float32)."""
    rows = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    set_attention(model, "sdpa")
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    indices = [torch.topk(torch.softmax(x.detach(), -1), 2, dim=-1).indices for x in out.router_logits]
    whole_batch_aux_loss(list(out.router_logits), indices, mask.reshape(-1)).backward()
    return out.aux_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def product_update(model, num_packs: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The update's path: the mini-batch's global counts, then each pack's SFT loss + COEF x its aux share; the
    gradient of the aux part alone (the loss's gradient at coef 0 subtracted)."""
    set_attention(model, "sdpa_segments")
    without_router_loss(model)
    batch = MiniBatch(PROMPTS, RESPONSES, [DemoTarget(torch.ones(len(r), dtype=torch.bool)) for r in RESPONSES])
    plan = plan_packs(batch.lengths(), 32, min_packs=num_packs)
    assert plan.num_packs == num_packs
    settings = SftLossSettings(agg_mode="token-mean", chunk_size=8)
    grads, metrics = {}, None
    for coef in (COEF, 0.0):
        norms = LossNormalizers(global_num_tokens=sum(map(len, RESPONSES)), global_num_seqs=3)
        norms = LossNormalizers(**{**norms.__dict__, "moe": step.moe_normalizers(
            model, batch, plan, coef=coef, device=torch.device("cpu"))})
        model.zero_grad()
        accumulated = step.accumulate_gradients(model, batch, loss_fn=packed_sft_loss, settings=settings,
                                                norms=norms, token_budget=32, device=torch.device("cpu"), plan=plan)
        grads[coef] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        metrics = metrics or finalize(accumulated.metrics)
    return metrics, {n: (grads[COEF][n] - grads[0.0][n]) / COEF for n in grads[COEF]}


@pytest.mark.parametrize("num_packs", [1, 2, 3])
def test_the_update_trains_transformers_aux_loss_of_the_whole_mini_batch(num_packs):
    model = tiny_moe()
    with Float64Mode():  # the router's softmax asks for float32: keep it float64, as check-metrics does
        want, want_grads = transformers_reference(model)
        metrics, grads = product_update(model, num_packs)
    assert metrics["moe/aux_loss"] == pytest.approx(want, rel=1e-6)  # transformers sums in float32
    assert want_grads["model.layers.0.mlp.gate.weight"].abs().max() > 0
    for name, grad in want_grads.items():
        if "gate.weight" in name or "embed" in name:
            assert torch.allclose(grads[name], grad, rtol=1e-9, atol=1e-13), name


def test_the_load_metrics_are_the_whole_mini_batch_routes():
    """The metrics of three packs are those of the counts of every sequence's own unpacked forward."""
    model = tiny_moe()
    metrics, _ = product_update(model, 3)
    counts = 0
    for p, r in zip(PROMPTS, RESPONSES):
        with torch.no_grad(), routing(model) as routes:
            model(input_ids=torch.tensor([p + r]))
        counts = counts + local_expert_counts([routes.indices[i] for i in (0, 1)], torch.ones(len(p + r)), 4)
    for layer in range(2):
        share = counts[layer] / counts[layer].sum()
        assert metrics[f"moe/layer_{layer}/load_max_share"] == float(share.max())
        assert metrics[f"moe/layer_{layer}/load_min_share"] == float(share.min())
    assert 0 < share.min() < share.max() < 1


def test_a_per_micro_batch_aux_loss_is_caught(monkeypatch):
    """Each pack's own transformers value (its own counts and token count) instead of its share of the global one."""
    model = tiny_moe()
    want, _ = transformers_reference(model)

    def own_value(logits_LTE, weights_T, norms, *, dp_size=1):
        indices = [torch.topk(torch.softmax(x.detach(), -1), 2, dim=-1).indices for x in logits_LTE]
        return whole_batch_aux_loss(logits_LTE, indices, weights_T) * dp_size

    monkeypatch.setattr(pack_losses, "aux_loss_share", own_value)
    metrics, _ = product_update(model, 1)
    assert metrics["moe/aux_loss"] == pytest.approx(want, rel=1e-6)  # one pack: the same number
    metrics, _ = product_update(model, 3)
    assert metrics["moe/aux_loss"] != pytest.approx(want, rel=1e-3)
