"""Sampling responses from the policy with transformers' ``generate``.

Generation runs with sdpa attention, a KV cache, left padding and an attention mask, never through the packed
training backends: a per-segment causal kernel with one query against a cache attends to key 0 only
(docs/architecture.md). ``generate`` turns on synced GPUs for FSDP-wrapped models, so ranks whose sequences stop at
different lengths keep stepping together.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from fsdptrain.data.rollout_record import split_response
from fsdptrain.generation.block import generation
from fsdptrain.generation.decoder import (
    Generated,
    OnFinish,
    Request,
    Sampling,
    active_recorder,
    decode_in_batches,
    generated_in_context,
)
from fsdptrain.generation.routes import RouteTape, records_routes
from fsdptrain.generation.row_sampling import RowSeededSampling


class GenerationLogprobs(LogitsProcessor):
    """Records each sampled token's ``log_softmax(logits / temperature)`` (after temperature, before top-p) as the
    generating forward computed it. It must run first (raw logits). A processor sees a step's logits before its
    token is drawn, so it keeps one step's ``[B, V]`` log-softmax and gathers it at the next call, whose
    ``input_ids`` end with that token; :meth:`finish` gathers the last step from the returned sequences."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: Optional[torch.Tensor] = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[B, num_new_tokens]`` log-probs of the generated tokens (``sequences``: prompt then new tokens)."""
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, sequences[:, -1:]).squeeze(1))
            self.pending = None
        return torch.stack(self.steps, dim=1) if self.steps else sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    do_sample: bool,
    generator_seed: int,
    device: torch.device,
    row_seeds: Optional[Sequence[int]] = None,
    synced_gpus: Optional[bool] = None,
    share_prompt_prefill: bool = False,
    record_logprobs: bool = False,
) -> list[tuple]:
    """Generate one response per prompt: ``(prompt_ids, response_ids, truncated)`` for each, in order.

    A prompt is a text (tokenised here, special tokens added) or a list of token ids used as they are (a rendered
    chat, whose template already wrote its special tokens); either way the batch is left-padded with a mask.

    Sampling draws from a forked RNG stream seeded from ``generator_seed``, so a step's rollouts are reproducible (and
    the same on resume) and the caller's global RNG state is left as it was; greedy decoding (``do_sample=False``) is
    used for evaluation. With ``row_seeds`` (one per prompt; ``do_sample`` must be False) each row samples at
    ``temperature`` from its own generator (:class:`RowSeededSampling`, top_p 1): the sampled evaluation, whose
    samples must not depend on how the rows are split over ranks.

    ``synced_gpus`` None lets transformers decide (on for an FSDP-wrapped model on several ranks: every rank steps
    until all are done); multi-turn rollouts pass False, since they generate with the weights gathered and each rank
    makes its own number of calls.

    ``share_prompt_prefill``: the prompts repeat (a GRPO group's ``rollout.n`` copies): their cache is computed once
    per distinct prompt (:func:`shared_prompt_cache`). Under FSDP the prefill is one more forward, so every rank must
    pass the same value (the caller's repeat count, the same on every rank).

    ``record_logprobs``: each tuple gets a fourth entry, the response tokens' log-probs as this generating forward
    computed them (:class:`GenerationLogprobs`: after temperature, before top-p).
    """
    input_ids, attention_mask, out, logprobs = _generate_padded(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        do_sample=do_sample, generator_seed=generator_seed, device=device, row_seeds=row_seeds,
        synced_gpus=synced_gpus, share_prompt_prefill=share_prompt_prefill, record_logprobs=record_logprobs)
    prompt_width = input_ids.shape[1]
    return [_row_result(input_ids, attention_mask, out, logprobs, row, prompt_width, tokenizer.eos_token_id)
            for row in range(len(prompts))]


@torch.no_grad()
def _generate_padded(model, tokenizer, prompts, *, max_new_tokens: int, temperature: float, top_p: float,
                     do_sample: bool, generator_seed: int, device: torch.device, row_seeds: Optional[Sequence[int]],
                     synced_gpus: Optional[bool], share_prompt_prefill: bool, record_logprobs: bool):
    """``generate`` as :func:`generate_responses` runs it: ``(input_ids, attention_mask, sequences, logprobs)``,
    the left-padded batch, the returned sequences (prompt then new tokens) and the new tokens' log-probs (None
    unless ``record_logprobs``)."""
    assert row_seeds is None or (not do_sample and len(row_seeds) == len(prompts)), "row_seeds: one per prompt, greedy"
    was_training = model.training
    model.eval()
    if prompts and not isinstance(prompts[0], str):
        enc = tokenizer.pad({"input_ids": [list(p) for p in prompts]}, return_tensors="pt", padding=True)
    else:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    input_ids = enc["input_ids"].to(device)
    attention_mask = enc["attention_mask"].to(device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if do_sample else dict(do_sample=False)
    recorder = GenerationLogprobs(temperature) if record_logprobs else None
    processors = [recorder] if recorder is not None else []
    if row_seeds is not None:
        processors.append(RowSeededSampling(row_seeds, temperature=temperature, device=device))
    if processors:
        sampling["logits_processor"] = LogitsProcessorList(processors)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices, device_type=device.type):
        torch.manual_seed(generator_seed)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
            **({} if synced_gpus is None else {"synced_gpus": synced_gpus}),
            **(shared_prompt_cache(model, input_ids, attention_mask) if share_prompt_prefill else {}),
            **sampling,
        )
    model.train(was_training)
    return input_ids, attention_mask, out, recorder.finish(out) if recorder is not None else None




def _row_result(input_ids, attention_mask, out, logprobs, row: int, prompt_width: int, eos_id: int) -> tuple:
    """Row ``row``'s ``(prompt_ids, response_ids, truncated[, logprobs])`` from ``generate``'s padded output."""
    prompt_ids = input_ids[row][attention_mask[row].bool()].tolist()
    response_ids, truncated = split_response(out[row, prompt_width:].tolist(), eos_id=eos_id)
    if logprobs is None:
        return prompt_ids, response_ids, truncated
    return prompt_ids, response_ids, truncated, logprobs[row, : len(response_ids)].tolist()


def shared_prompt_cache(model, input_ids, attention_mask) -> dict:
    """``{"cache": cache}`` holding the KV cache of every prompt token but the last, computed in one forward over the
    distinct prompts and copied to their repeats; ``{}`` for a batch one token wide (nothing to cache) or a model
    that returns no reorderable cache.

    A GRPO batch holds each prompt ``rollout.n`` times; ``generate`` would run the whole prompt through the model for
    every copy. With the cache given, ``generate`` runs only the uncached last prompt token of each row, then decodes
    as before. Each row's cached keys and values are those of its own prompt at the same positions (the rows are
    identical, padding included, and the positions are ``generate``'s: the mask's cumulative sum); only the batch
    size of the prefill's matmuls changes, which may change the last bits of a logit.
    """
    if input_ids.shape[1] < 2:
        return {}
    unique_rows, inverse = torch.unique(torch.cat([input_ids, attention_mask], dim=1), dim=0, return_inverse=True)
    first = torch.full((unique_rows.shape[0],), input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(input_ids.shape[0], device=input_ids.device), "amin")
    prefix_ids, prefix_mask = input_ids[first, :-1], attention_mask[first, :-1]
    position_ids = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 1)
    out = model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position_ids, use_cache=True,
                logits_to_keep=1)
    # transformers 5 names the cache `cache` (`past_key_values` before, and deprecated since)
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = getattr(out, name, None)
    if cache is None or not hasattr(cache, "reorder_cache"):
        return {}
    cache.reorder_cache(inverse)
    return {name: cache}


class GenerateDecoder:
    """The :class:`~fsdptrain.generation.decoder.Decoder` of ``rollout.engine=generate``: the requests of one
    ``Request.batch`` in one :func:`generate_responses`-style call per round
    (:func:`~fsdptrain.generation.decoder.decode_in_batches`), at the largest cap of the round, each row cut to its
    own. Training draws the batch from one generator (``Request.batch_seed``) at the call's temperature and top-p and
    records the log-probs; the sampled evaluation draws each row from its own (``Request.seed``,
    :class:`RowSeededSampling`); greedy takes the argmax. A continued turn prefills its whole context again (its
    ``kept`` is the context's ids). In an ``uneven`` block (ranks make their own numbers of calls) transformers'
    synced GPUs are off and no prompt prefill is shared, since a shared prefill is one more forward on every rank."""

    def __init__(self, cfg, model, tokenizer, device):
        self.cfg, self.model, self.tokenizer, self.device = cfg, model, tokenizer, device
        self._uneven = False

    @contextlib.contextmanager
    def generating(self, *, uneven: bool = False):
        self._uneven = uneven
        try:
            with generation(self.model, self.cfg, self.device, always_gather=uneven):
                yield
        finally:
            self._uneven = False

    def decode(self, requests, sampling: Sampling, *, on_finish: Optional[OnFinish] = None) -> list[Generated]:
        recorder = active_recorder()
        if recorder is not None:
            recorder.on_decode(requests, follow_ups=on_finish is not None)
        return decode_in_batches(requests, on_finish, lambda batch: self._generate(batch, sampling, recorder))

    def _generate(self, batch: list[Request], sampling: Sampling, recorder) -> list[Generated]:
        contexts = [list(r.kept or []) + list(r.new_ids) for r in batch]
        train = sampling.mode == "train"
        tape = RouteTape(self.model) if records_routes(self.model, sampling.mode) else None
        with _forward_routes(tape) as forwards:
            input_ids, _, out, logprobs = _generate_padded(
                self.model, self.tokenizer, contexts, max_new_tokens=max(r.max_new_tokens for r in batch),
                temperature=sampling.temperature, top_p=sampling.top_p, do_sample=train,
                generator_seed=(batch[0].batch_seed or 0) if train else 0, device=self.device,
                row_seeds=[r.seed for r in batch] if sampling.mode == "eval" else None,
                synced_gpus=False if self._uneven else None,
                # recording routes, each row prefills its own prompt: a shared prefill would be one more forward
                share_prompt_prefill=(sampling.repeat > 1 and sampling.mode != "eval" and not self._uneven
                                      and tape is None),
                record_logprobs=train)
        width = input_ids.shape[1]
        # every forward's columns side by side: column c holds the routes of the returned sequences' token c
        routes = torch.cat(forwards, dim=2) if tape is not None else None
        generated = []
        for row, (r, context) in enumerate(zip(batch, contexts)):
            new_tokens = out[row, width:].tolist()
            if recorder is not None:
                recorder.on_tokens(r.key, new_tokens, logprobs[row].tolist() if logprobs is not None else None)
            ids, truncated = split_response(new_tokens, eos_id=self.tokenizer.eos_token_id)
            row_logprobs = logprobs[row, :len(ids)].tolist() if logprobs is not None else []
            # the request's own tokens on: its kept context's were recorded by the turns that sampled them
            row_routes = routes[:, row, width - len(r.new_ids):].cpu() if routes is not None else None
            generated.append(generated_in_context(r, context, ids, not truncated, row_logprobs, row_routes))
        return generated


@contextlib.contextmanager
def _forward_routes(tape: Optional[RouteTape]):
    """Within the block, each forward of the tape's model appends its routes (``[L, rows, columns, k]``) to the
    yielded list; nothing without a tape."""
    forwards: list[torch.Tensor] = []
    if tape is None:
        yield forwards
        return

    def keep(_module, _args, kwargs, _output):
        forwards.append(tape.take(*kwargs["input_ids"].shape))

    with tape.recording():
        handle = tape.model.register_forward_hook(keep, with_kwargs=True)
        try:
            yield forwards
        finally:
            handle.remove()
