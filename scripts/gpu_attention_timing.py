"""One packed row's attention, forward + backward, on CUDA: each packed backend the machine offers vs the exact
`sdpa_segments` fallback (scripts/gpu_check.sh). Not a test: a timing, with the outputs' largest difference.

A bf16 row of 16 sequences (lengths 64..1024, 8192 tokens), 16 query heads and 4 key/value heads of 64 dims, as in a
0.5B-class model's layer; CUDA events, the median of 20 runs after 5 warm-ups.
"""

from __future__ import annotations

import statistics

import torch

from fsdptrain.model.attention_backends import flash_attn_attention, sdpa_segments_attention, torch_varlen_attention
from fsdptrain.model.attention_switch import available_backends


class _Layer(torch.nn.Module):
    """Stands in for an HF attention module: the backends read `is_causal` and `training` from it."""

    is_causal = True


def _time(fn, *args, **kwargs) -> tuple[float, torch.Tensor]:
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, _ = fn(*args, **kwargs)
        out.float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times), out.detach()


def main() -> None:
    lengths = [64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 1024, 448]
    total, heads, kv_heads, dim = sum(lengths), 16, 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, total, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    layer = _Layer()
    base_ms, base = _time(sdpa_segments_attention, layer, q, k, v, None, **kwargs)
    print(f"{total} tokens in {len(lengths)} segments, bf16, forward+backward, median of 20")
    print(f"sdpa_segments  {base_ms:8.3f} ms")
    kernels = {"flash_attn": flash_attn_attention, "torch_varlen": torch_varlen_attention}
    for name in available_backends("cuda", torch.bfloat16):
        if name in kernels:
            ms, out = _time(kernels[name], layer, q, k, v, None, **kwargs)
            diff = (out.float() - base.float()).abs().max().item()
            print(f"{name:<14} {ms:8.3f} ms  speed-up {base_ms / ms:5.2f}x  max |diff| vs sdpa_segments {diff:.2e}")


if __name__ == "__main__":
    main()
