"""Forwards of a packed row that return what the losses need, not logits.

The final hidden states come from one forward of the ROOT model (so FSDP2's root hooks run and the output head stays
unsharded for the fused loss, see fsdptrain/distributed/fsdp.py); the decoder's output is captured with a forward hook.
"""

from __future__ import annotations

from torch import Tensor

from fsdptrain.data.packing import PackedBatch
from fsdptrain.model.attention_switch import packed_model_inputs


def final_hidden_states(model, packed: PackedBatch) -> Tensor:
    """`[T, H]` hidden states after the final norm, from one forward of the ROOT model (so FSDP's root hooks run).

    The decoder's output is captured with a forward hook; ``logits_to_keep=1`` keeps the model's own projection to one
    position, whose logits are not used.
    """
    captured: dict[str, Tensor] = {}

    def keep_output(_module, _inputs, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = model.get_decoder().register_forward_hook(keep_output)
    try:
        model(**packed_model_inputs(packed), logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"][0]


def value_token_outputs(model, packed: PackedBatch) -> Tensor:
    """Per-token values `[T]` of a token-classification value model (one label) over the packed row, float32."""
    out = model(**packed_model_inputs(packed))
    return out.logits[0, :, 0].float()
