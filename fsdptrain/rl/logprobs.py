"""Per-token log-probs and entropy from final hidden states, chunked over tokens.

Shapes: T tokens (one packed row), H hidden size, V vocabulary, C tokens in one chunk. Suffixes give the layout:
`_T` [T], `_TH` [T, H], `_VH` [V, H], `_V` [V], `_CV` [C, V].

For token t with hidden state h_t, output weight W and bias b the logits are z_t = (W h_t + b) / temperature and

    logprob_t = z_t[target_t] - logsumexp(z_t)
    entropy_t = logsumexp(z_t) - sum_j p_tj z_tj = -sum_j p_tj log p_tj,    p_t = softmax(z_t).

`chunked_logprobs_entropy` computes these without ever holding the full [T, V] logits or their gradient: the
output projection is applied to `chunk_size` tokens at a time, the forward keeps only its inputs and two [T]
statistics (logsumexp, entropy), and the backward recomputes each chunk's logits. Peak extra memory is a few [C, V]
buffers plus an fp32 [V, H] gradient accumulator, instead of several [T, V] ones.

Gradients, per token (dropping t), with g_lp and g_H the upstream gradients of logprob and entropy:

    d logprob / d z_j = 1[j = target] - p_j
    d entropy / d z_j = -p_j (log p_j + H)

The second: d logsumexp / d z_j = p_j and d p_k / d z_j = p_k (1[k = j] - p_j), so
d (sum_k p_k z_k) / d z_j = p_j + p_j z_j - p_j sum_k p_k z_k, hence
dH/dz_j = p_j - p_j - p_j (z_j - sum_k p_k z_k) = -p_j (z_j - E_p[z]); and z_j - E_p[z] = log p_j + H because
log p_j = z_j - logsumexp(z) and H = logsumexp(z) - E_p[z]. Then with G = dL/dz of one chunk ([C, V]):
dL/dh = G W / temperature, dL/dW = G^T h / temperature, dL/db = sum over tokens of G / temperature.

Precision: all arithmetic runs in float32 (float64 stays float64), whatever the dtype of hidden and weight: a chunk of
hidden states and the weight are upcast before the projection, autocast is switched off inside, the outputs are
float32 and the gradients are accumulated in float32 and cast back to each input's dtype at the end. This is more
precise than a bf16 `lm_head` followed by `.float()`; `naive_logprobs_entropy` uses the same convention so the two
agree.

Tied embeddings: the weight may also be the input embedding elsewhere in the graph; autograd adds the gradient
returned here to the embedding's, as for any other use of a parameter.
"""

import torch

__all__ = ["chunked_logprobs_entropy", "naive_logprobs_entropy"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_inputs(hidden_TH, weight_VH, targets_T, temperature, chunk_size, bias_V) -> None:
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2:
        raise ValueError(
            f"hidden must be [T, H] and weight [V, H], got {tuple(hidden_TH.shape)} and {tuple(weight_VH.shape)}; "
            "flatten a packed row [1, T, H] with hidden[0]"
        )
    num_tokens, hidden_size = hidden_TH.shape
    vocab_size = weight_VH.shape[0]
    if weight_VH.shape[1] != hidden_size:
        raise ValueError(f"weight is [V, H] = {tuple(weight_VH.shape)} but hidden has H = {hidden_size}")
    if targets_T.shape != (num_tokens,):
        raise ValueError(f"targets must be [T] = [{num_tokens}], got {tuple(targets_T.shape)}")
    if targets_T.dtype.is_floating_point or targets_T.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets_T.dtype}")
    if bias_V is not None and bias_V.shape != (vocab_size,):
        raise ValueError(f"bias must be [V] = [{vocab_size}], got {tuple(bias_V.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Masked positions (e.g. each sequence's last token) still need an id in range: use any valid id, not -100.
    if num_tokens and (int(targets_T.min()) < 0 or int(targets_T.max()) >= vocab_size):
        raise ValueError(
            f"targets must lie in [0, {vocab_size}); give masked positions any valid id (e.g. 0) and mask them "
            "in the loss instead of using an ignore index"
        )


def _chunk_logits(hidden_CH, weight_VH, bias_V, temperature: float, out_CV: torch.Tensor) -> torch.Tensor:
    """out_CV = (hidden_CH W^T + b) / temperature in out_CV's dtype; weight and bias are already in that dtype."""
    hidden_CH = hidden_CH.to(out_CV.dtype)
    if bias_V is None:
        torch.mm(hidden_CH, weight_VH.T, out=out_CV)
    else:
        torch.addmm(bias_V, hidden_CH, weight_VH.T, out=out_CV)
    if temperature != 1.0:
        out_CV.div_(temperature)
    return out_CV


_CPU_BLOCK_BYTES = 2 * 2**20  # a core's L2 on the EPYC this was tuned on (docs/performance.md)


def _chunk_buffers(num_tokens, chunk_size, vocab_size, count, dtype, device) -> list[torch.Tensor]:
    """`count` [C, V] work buffers reused by every chunk: a fresh C x V allocation per chunk is a fresh mmap on the
    CPU, and its page faults cost as much as the arithmetic."""
    rows = min(chunk_size, num_tokens)
    return [torch.empty(rows, vocab_size, dtype=dtype, device=device) for _ in range(count)]


def _forward_chunk(logits_CV, targets_C, exp_CV):
    """(logsumexp, log-prob of the target, entropy or None) of one chunk's logits, `[C]` each; overwrites the buffers.

    logsumexp by hand: torch.logsumexp allocates [C, V] temporaries and took twice as long as max/exp/sum here. The
    entropy is logsumexp(z) - sum_j p_j z_j = log S - (sum_j e_j s_j) / S with s = z - max, e = exp(s), S = sum e:
    one batched dot instead of materialising p and log p.
    """
    max_C1 = logits_CV.amax(dim=-1, keepdim=True)
    shifted_CV = logits_CV.sub_(max_C1)
    shifted_target_C = shifted_CV.gather(1, targets_C.unsqueeze(-1)).squeeze(-1)
    entropy_C = None
    if exp_CV is None:  # log-probs only: one buffer, exp in place
        sumexp_C = shifted_CV.exp_().sum(dim=-1)
    else:
        torch.exp(shifted_CV, out=exp_CV)
        sumexp_C = exp_CV.sum(dim=-1)
        dot_C = torch.bmm(exp_CV.unsqueeze(1), shifted_CV.unsqueeze(2)).view(-1)
        entropy_C = sumexp_C.log() - dot_C / sumexp_C
    log_sumexp_C = sumexp_C.log()
    return max_C1.squeeze(-1) + log_sumexp_C, shifted_target_C - log_sumexp_C, entropy_C


def _backward_dense(logits_CV, lse_C, grad_lp_C, entropy_C, grad_ent_C, p_CV) -> torch.Tensor:
    """The dense part D of dL/dz of some rows, in place, and their sign r: dL/dz = r D + g_lp onehot(target).

    Without entropy, D = exp(z - lse + log|g_lp|) = |g_lp| p in `logits_CV`, r = -sign(g_lp): one subtraction and
    one exp. With it, D = p (g_lp + g_H (log p + H)) in `p_CV`, r = -1.
    """
    if grad_ent_C is None:
        shift_C1 = (lse_C - grad_lp_C.abs().log()).unsqueeze(-1)  # g_lp = 0: shift +inf, D = 0
        logits_CV.sub_(shift_C1).exp_()
        return -grad_lp_C.sign()
    logp_CV = logits_CV.sub_(lse_C.unsqueeze(-1))
    torch.exp(logp_CV, out=p_CV)
    coef_CV = logp_CV.mul_(grad_ent_C.unsqueeze(-1)).add_((grad_lp_C + grad_ent_C * entropy_C).unsqueeze(-1))
    p_CV.mul_(coef_CV)
    return torch.full_like(grad_lp_C, -1.0)


def _row_blocks(num_rows: int, vocab_size: int, device: torch.device) -> list[slice]:
    """Row blocks of a chunk for its elementwise passes: on the CPU blocks of about `_CPU_BLOCK_BYTES`, so that the
    several passes over a block run in cache (a [C, V] chunk itself is tens of MB); elsewhere the whole chunk."""
    step = max(1, _CPU_BLOCK_BYTES // (4 * vocab_size)) if device.type == "cpu" else num_rows
    return [slice(a, min(a + step, num_rows)) for a in range(0, num_rows, max(1, step))]


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Saves hidden, weight, bias, targets and the [T] logsumexp/entropy; recomputes chunk logits in backward."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, bias_V, targets_T, temperature, chunk_size, compute_entropy):
        dtype = _compute_dtype(hidden_TH, weight_VH, bias_V)
        num_tokens, vocab_size, device = hidden_TH.shape[0], weight_VH.shape[0], hidden_TH.device
        with torch.autocast(device_type=device.type, enabled=False):
            weight_c = weight_VH.to(dtype)
            bias_c = None if bias_V is None else bias_V.to(dtype)
            logprobs_T = torch.empty(num_tokens, dtype=dtype, device=device)
            lse_T = torch.empty_like(logprobs_T)
            entropy_T = torch.empty(num_tokens if compute_entropy else 0, dtype=dtype, device=device)
            buffers = _chunk_buffers(num_tokens, chunk_size, vocab_size, 2 if compute_entropy else 1, dtype, device)
            for start in range(0, num_tokens, chunk_size):
                end = min(start + chunk_size, num_tokens)
                logits_CV = _chunk_logits(hidden_TH[start:end], weight_c, bias_c, temperature,
                                          buffers[0][: end - start])
                for rows in _row_blocks(end - start, vocab_size, device):
                    at = slice(start + rows.start, start + rows.stop)
                    exp_CV = buffers[1][rows] if compute_entropy else None
                    lse_T[at], logprobs_T[at], entropy_C = _forward_chunk(logits_CV[rows], targets_T[at], exp_CV)
                    if compute_entropy:
                        entropy_T[at] = entropy_C
            del buffers
        ctx.save_for_backward(hidden_TH, weight_VH, bias_V, targets_T, lse_T, entropy_T)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.compute_entropy = compute_entropy
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        hidden_TH, weight_VH, bias_V, targets_T, lse_T, entropy_T = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        dtype = lse_T.dtype
        num_tokens, vocab_size, device = hidden_TH.shape[0], weight_VH.shape[0], hidden_TH.device
        with torch.autocast(device_type=device.type, enabled=False):
            weight_c = weight_VH.to(dtype)
            bias_c = None if bias_V is None else bias_V.to(dtype)
            grad_lp_T = grad_logprobs_T.to(dtype)
            grad_ent_T = grad_entropy_T.to(dtype) if ctx.compute_entropy else None
            grad_hidden_TH = torch.empty(hidden_TH.shape, dtype=dtype, device=device) if need_hidden else None
            grad_weight_VH = torch.zeros_like(weight_c) if need_weight else None
            grad_bias_V = torch.zeros_like(bias_c) if need_bias else None
            buffers = _chunk_buffers(num_tokens, chunk_size, vocab_size, 1 if grad_ent_T is None else 2, dtype,
                                     device)
            for start in range(0, num_tokens, chunk_size):
                end = min(start + chunk_size, num_tokens)
                hidden_CH = hidden_TH[start:end].to(dtype)
                targets_C, grad_lp_C = targets_T[start:end], grad_lp_T[start:end]
                logits_CV = _chunk_logits(hidden_CH, weight_c, bias_c, temperature, buffers[0][: end - start])
                dense_CV = buffers[-1][: end - start]
                sign_C = torch.cat([
                    _backward_dense(logits_CV[rows], lse_T[at], grad_lp_T[at], entropy_T[at],
                                    None if grad_ent_T is None else grad_ent_T[at], dense_CV[rows])
                    for rows in _row_blocks(end - start, vocab_size, device)
                    for at in [slice(start + rows.start, start + rows.stop)]])
                # dL/dz = r D + g_lp onehot(target); the row factors r / temperature and g_lp / temperature are
                # applied to the [C, H] sides of the products, never to the [C, V] buffer.
                row_C1, target_C1 = (sign_C / temperature).unsqueeze(-1), (grad_lp_C / temperature).unsqueeze(-1)
                if need_hidden:
                    out_CH = torch.mm(dense_CV, weight_c, out=grad_hidden_TH[start:end]).mul_(row_C1)
                    out_CH.add_(weight_c.index_select(0, targets_C).mul_(target_C1))
                if need_weight:
                    grad_weight_VH.addmm_(dense_CV.T, hidden_CH * row_C1)
                    grad_weight_VH.index_add_(0, targets_C, hidden_CH * target_C1)
                if need_bias:
                    grad_bias_V.addmv_(dense_CV.T, row_C1.squeeze(-1))
                    grad_bias_V.index_add_(0, targets_C, target_C1.squeeze(-1))
            del buffers
        if need_hidden:
            grad_hidden_TH = grad_hidden_TH.to(hidden_TH.dtype)
        if need_weight:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        if need_bias:
            grad_bias_V = grad_bias_V.to(bias_V.dtype)
        return grad_hidden_TH, grad_weight_VH, grad_bias_V, None, None, None, None


def chunked_logprobs_entropy(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    bias_V: torch.Tensor | None = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob of `targets_T` and entropy under softmax((hidden W^T + b) / temperature), chunked.

    Args:
        hidden_TH: final hidden states [T, H] (any float dtype; T may be 0, an empty pack).
        weight_VH: output projection [V, H] (e.g. `lm_head.weight`, possibly tied to the input embedding).
        targets_T: token ids [T] in [0, V); positions the loss masks still need a valid id.
        temperature: the logits are divided by it (> 0).
        chunk_size: tokens per chunk; peak extra memory is a few [chunk_size, V] float32 buffers.
        bias_V: optional output bias [V].
        compute_entropy: when False the entropy is neither computed nor returned (None).

    Returns:
        (logprobs_T, entropy_T), float32 (float64 for float64 inputs), [T] each; entropy_T is None when not asked.
        Differentiable with respect to hidden, weight and bias; no [T, V] tensor is kept for backward.
    """
    _check_inputs(hidden_TH, weight_VH, targets_T, temperature, chunk_size, bias_V)
    logprobs_T, entropy_T = _ChunkedLogprobsEntropy.apply(
        hidden_TH, weight_VH, bias_V, targets_T.long(), float(temperature), int(chunk_size), bool(compute_entropy)
    )
    return logprobs_T, (entropy_T if compute_entropy else None)


def naive_logprobs_entropy(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias_V: torch.Tensor | None = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: full [T, V] logits -> log_softmax -> gather, plain autograd. Same contract and precision as
    `chunked_logprobs_entropy`; holds several [T, V] tensors, so use it for tests and small inputs only."""
    _check_inputs(hidden_TH, weight_VH, targets_T, temperature, 1, bias_V)
    dtype = _compute_dtype(hidden_TH, weight_VH, bias_V)
    with torch.autocast(device_type=hidden_TH.device.type, enabled=False):
        bias_c = None if bias_V is None else bias_V.to(dtype)
        logits_TV = torch.nn.functional.linear(hidden_TH.to(dtype), weight_VH.to(dtype), bias_c)
        if temperature != 1.0:
            logits_TV = logits_TV / temperature
        logp_TV = torch.log_softmax(logits_TV, dim=-1)
        logprobs_T = logp_TV.gather(-1, targets_T.long().unsqueeze(-1)).squeeze(-1)
        entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1) if compute_entropy else None
    return logprobs_T, entropy_T
