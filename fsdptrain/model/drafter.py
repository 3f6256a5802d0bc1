"""An EAGLE-3 drafter co-trained with the policy: the head, its draft vocabulary and the feature capture
(`drafter_export` writes and reads it on disk).

Legend: `_T` per-position tensors of one packed row, `_TH` `[T, H]`, `_TK` `[T, 3 H_target]`, `_D` draft vocabulary.

What is built (docs/drafter.md has the diagram and the sources): the layout vLLM's `Eagle3LlamaForCausalLM` and
SGLang's `LlamaForCausalLMEagle3` load, whatever the policy's architecture:

    fused  = fc([f_low ; f_mid ; f_high])                  fc: Linear(3 H_target -> H), no bias
    x      = [input_layernorm(e_{t+1}) ; hidden_norm(fused)]   2H: the next token's embedding first
    r      = fused + o_proj(attn(x))                        q/k/v: Linear(2H -> heads), RoPE at the row's positions
    out    = norm(r + mlp(post_attention_layernorm(r)))
    logits = lm_head(out)                                   lm_head: Linear(H -> D), D = draft_vocab_size

f_* are the residual streams entering three policy decoder layers (`feature_layers`, the index convention of HF's
`output_hidden_states` and of vLLM's `eagle_aux_hidden_state_layer_ids`: i is the input of layer i, 0 the
embeddings), read detached; e_{t+1} is the policy's own input embedding of token t+1, read detached (the drafter
holds no embedding: both engines fall back to the target's when the checkpoint has none).

With `num_layers` > 1 (vLLM's multi-layer EAGLE-3 head; SGLang loads one layer only), plain Llama decoder layers
`layers.{i}` (i >= 1) follow the midlayer on the H-wide stream `r + mlp(...)`, and the final norm takes the last one's
output (vLLM's fused add-and-norm, unfused).

Departures: the midlayer is always Llama's (RMSNorm, SwiGLU MLP, RoPE, no biases), with the
policy's sizes and RoPE parameters, also for a Qwen2 policy (sliding windows and q/k/v biases are not copied), as the
engines' EAGLE-3 heads are Llama heads for every target; no training-time-test unrolling (one draft step).

The attention runs through transformers' AttentionInterface with the drafter's `config._attn_implementation`, so the
packed backends of `fsdptrain.model.attention_switch` serve it over the same segments as the policy: no position sees another
sequence of the pack. This module never imports a loss.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from fsdptrain.data.packing import PackedBatch
from fsdptrain.model.attention_switch import packed_model_inputs
from fsdptrain.model.loading import decoder_layers


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default (2, L // 2, L - 3) for L >= 5 decoder layers, clamped into [0, L) for tiny models."""
    if num_layers < 1:
        raise ValueError(f"the policy needs at least one decoder layer, got {num_layers}")
    return min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)


# ---- the draft vocabulary ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftVocab:
    """The D target ids the drafter can propose, in ascending order.

    d2t: long `[D]`, EAGLE-3's offset form: target id = draft index + d2t[draft index] (vLLM adds
    `arange(D)`, SGLang builds `hot_token_id` the same way). t2d: bool `[V]`, True for the draft ids.
    """

    d2t: Tensor
    t2d: Tensor

    @staticmethod
    def from_target_ids(target_ids: Iterable[int], vocab_size: int) -> "DraftVocab":
        ids = sorted({int(i) for i in target_ids})
        if not ids:
            raise ValueError("a draft vocabulary needs at least one token id")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"draft token ids must lie in [0, {vocab_size}), got {ids[0]} .. {ids[-1]}")
        target = torch.tensor(ids, dtype=torch.long)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[target] = True
        return DraftVocab(d2t=target - torch.arange(len(ids)), t2d=t2d)

    @property
    def draft_to_target(self) -> Tensor:
        """long `[D]`: the target id of each draft index."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def size(self) -> int:
        return self.d2t.numel()


def build_draft_vocab(sequences: Iterable[Sequence[int] | Tensor], *, vocab_size: int,
                      draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent ids of `sequences` (e.g. the first steps' rollouts); ties and the
    remainder when fewer distinct ids were seen go to the lowest ids, so the result is deterministic."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"drafter.draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.tolist() if isinstance(seq, Tensor) else [int(t) for t in seq])
    ranked = sorted(counts, key=lambda i: (-counts[i], i))[:draft_vocab_size]
    chosen = set(ranked)
    filler = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < draft_vocab_size:
        chosen.add(next(filler))
    return DraftVocab.from_target_ids(chosen, vocab_size)


def draft_vocab_from_counts(counts_V: Tensor, *, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` ids of highest count in `counts_V` (`[V]`, e.g. all-reduced over ranks), ties and
    unseen ids by the lowest id: the same choice as `build_draft_vocab` on the sequences counted."""
    vocab_size = counts_V.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"drafter.draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    order = torch.argsort(-counts_V.to(torch.float64).cpu(), stable=True)  # stable: equal counts keep id order
    return DraftVocab.from_target_ids(order[:draft_vocab_size].tolist(), vocab_size)


def save_draft_vocab(vocab: DraftVocab, path: str | os.PathLike) -> None:
    """A JSON file `{"vocab_size": V, "token_ids": [...]}` (ascending target ids)."""
    data = {"vocab_size": vocab.t2d.numel(), "token_ids": vocab.draft_to_target.tolist()}
    Path(path).write_text(json.dumps(data))


def load_draft_vocab(path: str | os.PathLike, *, vocab_size: int) -> DraftVocab:
    """Read a vocabulary file written by `save_draft_vocab` (or any JSON list of target ids)."""
    data = json.loads(Path(path).read_text())
    ids = data["token_ids"] if isinstance(data, dict) else data
    if isinstance(data, dict) and data.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{path} was built for a vocabulary of {data['vocab_size']} tokens, the policy has "
                         f"{vocab_size}: rebuild it from this tokenizer's rollouts")
    return DraftVocab.from_target_ids(ids, vocab_size)


# ---- the head ---------------------------------------------------------------------------------------------------


def draft_config(target_config: PretrainedConfig, *, draft_vocab_size: int, num_layers: int = 1) -> LlamaConfig:
    """The drafter's LlamaConfig: the target's sizes and RoPE, `num_layers` layers, no biases, untied head."""
    if num_layers < 1:
        raise ValueError(f"drafter.num_layers must be at least 1, got {num_layers}")
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=dict(target_config.rope_parameters),
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        initializer_range=getattr(target_config, "initializer_range", 0.02),
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=hidden,
    )


class Eagle3MidLayer(nn.Module):
    """The EAGLE-3 decoder layer: q/k/v read [norm(embeds) ; norm(fused)] (2H), the residual is `fused`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * attn.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds, fused, position_embeddings, **attention_kwargs) -> tuple[Tensor, Tensor]:
        """(mlp output, residual); the caller's final norm adds them (the engines' fused add-and-norm)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(fused)], dim=-1)
        attn_out, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=None,
                                     **attention_kwargs)
        residual = fused + attn_out
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 head. Parameter and buffer names are the exported ones: fc.weight, midlayer.*, layers.{i}.* (i >= 1,
    with num_hidden_layers > 1), norm.weight, lm_head.weight, d2t, t2d (so `state_dict()` is the checkpoint)."""

    def __init__(self, config: LlamaConfig, vocab: DraftVocab, feature_layers: Sequence[int]):
        super().__init__()
        if len(feature_layers) != 3:
            raise ValueError(f"drafter.feature_layers must name 3 policy layers, got {list(feature_layers)}")
        if vocab.size != config.draft_vocab_size or vocab.t2d.numel() != config.vocab_size:
            raise ValueError(f"the draft vocabulary ({vocab.size} of {vocab.t2d.numel()}) does not match the config "
                             f"({config.draft_vocab_size} of {config.vocab_size})")
        self.config = config
        self.feature_layers = tuple(int(i) for i in feature_layers)
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        # vLLM names the midlayer layers.0 and the later ones layers.{i}: a dict keyed from 1 keeps those names
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config, layer_idx=i)
                                     for i in range(1, config.num_hidden_layers)})
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())
        if config._attn_implementation is None:
            config._attn_implementation = "sdpa"
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range), norms 1 (transformers' Llama initialisation)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(d2t=self.d2t, t2d=self.t2d)

    @property
    def draft_to_target(self) -> Tensor:
        return self.vocab.draft_to_target

    @contextlib.contextmanager
    def attention(self, name: str) -> Iterator[str]:
        """Run the block with the drafter's attention set to `name` (e.g. a packed backend), then restore it."""
        previous = self.config._attn_implementation
        self.config._attn_implementation = name
        try:
            yield name
        finally:
            self.config._attn_implementation = previous

    def forward(self, features_TK: Tensor, next_embeds_TH: Tensor, *, position_ids: Tensor,
                **attention_kwargs) -> Tensor:
        """Final (normed) hidden states `[T, H]` of one row. features_TK: the three feature layers concatenated
        `[T, 3 H_target]`; next_embeds_TH: row t holds the embedding of token t+1; position_ids `[1, T]`;
        attention_kwargs: the packed segments (`cu_seq_lens_q/k`, `max_length_q/k`) for a packed backend."""
        # the policy's features arrive in its compute dtype (bf16 under mixed precision)
        fused = self.fc(features_TK.to(self.fc.weight.dtype))[None]
        embeds = next_embeds_TH.to(fused.dtype)[None]
        position_embeddings = self.rotary_emb(fused, position_ids)
        mlp_out, residual = self.midlayer(embeds, fused, position_embeddings, position_ids=position_ids,
                                          **attention_kwargs)
        hidden = mlp_out + residual
        for layer in self.layers.values():
            hidden = layer(hidden, position_embeddings=position_embeddings, position_ids=position_ids,
                           **attention_kwargs)
        return self.norm(hidden)[0]

    def compute_logits(self, hidden_TH: Tensor) -> Tensor:
        """Draft-vocabulary logits `[T, D]` (unscaled; the loss computes these chunk by chunk instead)."""
        return self.lm_head(hidden_TH)

    @classmethod
    def from_policy(cls, policy: nn.Module, vocab: DraftVocab, *, feature_layers: Optional[Sequence[int]] = None,
                    init_head_from_policy: bool = True, num_layers: int = 1) -> "Eagle3Drafter":
        """A drafter sized for `policy` (a plain, unsharded HF causal LM). With `init_head_from_policy` the draft
        head starts as the policy's output rows of the draft vocabulary (a warm start; EAGLE-3 trains it)."""
        config = draft_config(policy.config, draft_vocab_size=vocab.size, num_layers=num_layers)
        policy_layers = len(decoder_layers(policy))
        layers = tuple(feature_layers) if feature_layers is not None else default_feature_layers(policy_layers)
        if any(not 0 <= i < policy_layers for i in layers):
            raise ValueError(f"drafter.feature_layers {list(layers)} must lie in [0, {policy_layers}) for this policy")
        drafter = cls(config, vocab, layers)
        if init_head_from_policy:
            with torch.no_grad():
                rows = policy.get_output_embeddings().weight[vocab.draft_to_target]
                drafter.lm_head.weight.copy_(rows)
        return drafter.to(next(policy.parameters()).dtype)


# ---- feature capture from the policy's packed forward -----------------------------------------------------------


@dataclass(frozen=True)
class PolicyFeatures:
    """What one packed forward of the policy yields for the policy loss and the drafter.

    final_hidden_TH: after the final norm, attached to the graph (the policy loss's input); features_TK: the three
    feature layers' inputs concatenated, detached; embeds_TH: the input embeddings of the row, detached.
    """

    final_hidden_TH: Tensor
    features_TK: Tensor
    embeds_TH: Tensor


def _first_tensor(args, kwargs) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def capture_policy_features(model: nn.Module, packed: PackedBatch, *, feature_layers: Sequence[int]) -> PolicyFeatures:
    """One forward of the ROOT policy model over the packed row, capturing by hooks (they only read and detach, so
    the policy's graph, and hence its gradients, are those of `fsdptrain.model.forward.final_hidden_states`)."""
    captured: dict = {}
    layers = decoder_layers(model)
    handles = []

    def keep_output(_module, _inputs, output):
        captured["final"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def keep_embeds(_module, _inputs, output):
        captured["embeds"] = output.detach()

    def keep_layer_input(index):
        def hook(_module, args, kwargs):
            captured[index] = _first_tensor(args, kwargs).detach()
        return hook

    handles.append(model.get_decoder().register_forward_hook(keep_output))
    handles.append(model.get_input_embeddings().register_forward_hook(keep_embeds))
    for index in sorted(set(feature_layers)):
        handles.append(layers[index].register_forward_pre_hook(keep_layer_input(index), with_kwargs=True))
    try:
        model(**packed_model_inputs(packed), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    features = torch.cat([captured[i][0] for i in feature_layers], dim=-1)
    return PolicyFeatures(final_hidden_TH=captured["final"][0], features_TK=features,
                          embeds_TH=captured["embeds"][0])


def next_token_embeds(embeds_TH: Tensor, label_mask_T: Tensor) -> Tensor:
    """Row t gets the embedding of token t+1 where t+1 is in t's sequence (`label_mask`), zero elsewhere (each
    sequence's last position and the tail), so no row reads across a segment boundary."""
    shifted = torch.cat([embeds_TH[1:], embeds_TH.new_zeros(1, embeds_TH.shape[-1])])[: embeds_TH.shape[0]]
    return torch.where(label_mask_T.reshape(-1, 1).to(shifted.device), shifted, torch.zeros_like(shifted))


def run_drafter(drafter: Eagle3Drafter, features: PolicyFeatures, packed: PackedBatch) -> Tensor:
    """The drafter's final hidden states `[T, H]` over the packed row, on the same segments as the policy (the
    drafter's attention implementation must be a packed backend, e.g. via `drafter.attention('sdpa_segments')`)."""
    inputs = packed_model_inputs(packed)
    segments = {k: inputs[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    next_embeds = next_token_embeds(features.embeds_TH, packed.label_mask[0])
    return drafter(features.features_TK, next_embeds, position_ids=packed.position_ids, **segments)


def teacher_head_rows(model: nn.Module, drafter: Eagle3Drafter) -> tuple[Tensor, Optional[Tensor]]:
    """The draft rows `[D, H]` (and bias `[D]`) of the policy's output projection, detached. Read it after the
    policy's forward (the root FSDP unit keeps the head unsharded until its backward ends)."""
    head = model.get_output_embeddings()
    rows = drafter.draft_to_target.to(head.weight.device)
    bias = None if head.bias is None else head.bias.detach()[rows]
    return head.weight.detach()[rows], bias
