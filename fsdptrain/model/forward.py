"""Forwards of a packed row that return what the losses need, not logits.

The final hidden states come from one forward of the ROOT model (so FSDP2's root hooks run and the output head stays
unsharded for the fused loss, see fsdptrain/distributed/fsdp.py); the decoder's output is captured with a forward hook.

A pack with shared prompts (`fsdptrain.data.shared_prompts.SharedPromptPack`) runs the model on its model row (each
prompt once) and returns the outputs at the loss row's positions, gathered through `source_T`: callers see the same
`[T, ...]` layout either way.
"""

from __future__ import annotations

from torch import Tensor

from fsdptrain.data.packing import PackedBatch
from fsdptrain.data.shared_prompts import SharedPromptPack
from fsdptrain.model.attention_switch import packed_model_inputs, shared_model_inputs


def _model_inputs(packed: PackedBatch, shard=None) -> dict:
    if shard is not None:  # context parallelism: this rank's positions (fsdptrain/distributed/context_parallel.py)
        return shard.model_inputs(packed)
    if isinstance(packed, SharedPromptPack):
        return shared_model_inputs(packed.model_row)
    return packed_model_inputs(packed)


def _at_loss_positions(outputs_T: Tensor, packed: PackedBatch) -> Tensor:
    """The model row's outputs `[T_M, ...]` at the loss row's positions `[T, ...]` (the same tensor unshared)."""
    if isinstance(packed, SharedPromptPack):
        return outputs_T.index_select(0, packed.model_row.source_T)
    return outputs_T


def final_hidden_states(model, packed: PackedBatch, shard=None) -> Tensor:
    """`[T, H]` hidden states after the final norm, from one forward of the ROOT model (so FSDP's root hooks run);
    with a context-parallel `shard` (`ContextShard`), `[L, H]` at this rank's positions of the row.

    The decoder's output is captured with a forward hook; ``logits_to_keep=1`` keeps the model's own projection to one
    position, whose logits are not used.
    """
    captured: dict[str, Tensor] = {}

    def keep_output(_module, _inputs, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = model.get_decoder().register_forward_hook(keep_output)
    try:
        model(**_model_inputs(packed, shard), logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"][0] if shard is not None else _at_loss_positions(captured["hidden"][0], packed)


def value_token_outputs(model, packed: PackedBatch, shard=None) -> Tensor:
    """Per-token values `[T]` of a token-classification value model (one label) over the packed row, float32; with
    a context-parallel `shard`, `[L]` at this rank's positions."""
    out = model(**_model_inputs(packed, shard))
    values = out.logits[0, :, 0].float()
    return values if shard is not None else _at_loss_positions(values, packed)
