"""Activation checkpointing recomputes each decoder layer under the attention implementation its forward ran under
(fsdptrain/distributed/fsdp.py, ``apply_activation_checkpointing``).

The attention implementation is model state that ``packed_attention`` / ``generation_attention`` switch for the
duration of a forward. A backward after the block has exited recomputes the checkpointed layers; these tests check that
the gradients then equal those of the same model without checkpointing (fp32, 1e-6), on a packed row (recomputed on
plain sdpa it would attend across sequences) and on a padded batch (recomputed on sdpa_segments it would be refused).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fsdptrain.data.packing import pack_sequences, pad_sequences
from fsdptrain.distributed.fsdp import apply_activation_checkpointing
from fsdptrain.model.attention_switch import generation_attention, packed_attention, packed_model_inputs, set_attention

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
RESPONSES = [[14, 15, 16, 17], [18, 19, 20], [21, 22]]


def _models(resting_attention: str) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The same tiny Llama twice, the second with checkpointed layers; both at rest on ``resting_attention``."""
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation="sdpa"))
    checkpointed = LlamaForCausalLM(LlamaConfig(**TINY, attn_implementation="sdpa"))
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed)
    for model in (plain, checkpointed):
        set_attention(model, resting_attention)
        model.train()
    return plain, checkpointed


def _packed_loss(model) -> torch.Tensor:
    packed = pack_sequences(PROMPTS, RESPONSES, [0, 1, 2])
    with packed_attention(model, "sdpa_segments"):
        logits = model(**packed_model_inputs(packed)).logits
    return (logits.float().square().mean() * torch.arange(logits.shape[1]).view(1, -1, 1)).mean()


def _padded_loss(model) -> torch.Tensor:
    batch = pad_sequences(PROMPTS, RESPONSES)
    with generation_attention(model):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return (logits.float().square() * batch.attention_mask[..., None]).mean()


def _grads(model) -> dict[str, torch.Tensor]:
    return {name.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss_of, resting", [(_packed_loss, "sdpa"), (_padded_loss, "sdpa_segments")],
                         ids=["packed-row-backward-after-packed_attention", "padded-backward-after-generation_attention"])
def test_backward_outside_the_attention_switch_recomputes_on_the_forwards_backend(loss_of, resting):
    plain, checkpointed = _models(resting)
    loss_of(plain).backward()
    loss_of(checkpointed).backward()  # recomputes the layers here, after the switch has restored `resting`
    want, got = _grads(plain), _grads(checkpointed)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    assert checkpointed.config._attn_implementation == resting  # the recomputation restored it


def test_recomputation_runs_under_the_forwards_function_modes():
    # check-metrics' float64 mode is a torch function mode (float32 requests become float64): a layer recomputed
    # outside it would compute its RMSNorm in float32 and torch would refuse the recomputation's metadata
    from fsdptrain.check.precision import Float64Mode

    plain, checkpointed = _models("sdpa")
    for model in (plain, checkpointed):
        model.double()
    losses = []
    for model in (plain, checkpointed):
        with Float64Mode():
            losses.append(_packed_loss(model))
    for loss in losses:
        loss.backward()  # outside the mode, as the check's backward may run
    want, got = _grads(plain), _grads(checkpointed)
    assert all(g.dtype == torch.float64 for g in got.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-14, msg=name)
