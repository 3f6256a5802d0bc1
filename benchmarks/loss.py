"""Benchmark of the loss path from final hidden states (not a test): memory and time, chunked vs naive.

    PYTHONPATH=. python benchmarks/loss.py                 # all sections, the issue's sizes
    PYTHONPATH=. python benchmarks/loss.py --sections memory --tokens 4096

Sections:
- memory: peak extra memory of forward+backward from the hidden states, chunked vs naive (full [T, V] logits ->
  log_softmax -> gather), each in its own process, as peak RSS minus the RSS once the inputs were built.
  Goal: the chunked path's extra memory is at most a quarter of the naive one's.
- timing: the same two paths, forward+backward and forward alone under no_grad (the experience pass), at that size.
- packed: the fused packed policy loss (`fsdptrain.train.step.packed_policy_loss`: one packed forward per pack of
  a small Llama, the chunked projection, the loss once per row) vs the per-sequence reference loop
  (`per_sequence_policy_loss`), at 8 and 64 sequences of log-normal lengths (mean about 128), V=32000, hidden 512.
  Goal: the fused path is never slower.

Times are the best of --repeats runs after a warm-up (the packed section warms up on its first 8 sequences): the
machine is shared, and the minimum is the measure least disturbed by other work. Every measurement runs in a fresh
subprocess (this file with --worker), one at a time, so that one path's allocations never inflate another's peak and
the machine is not asked for two naive peaks at once.

Suffixes: `_T` [T], `_TH` [T, H], `_VH` [V, H].
"""

import argparse
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time

import torch

from fsdptrain.check.per_sequence import per_sequence_policy_loss
from fsdptrain.config.schema import LossConfig
from fsdptrain.data.packing import pack_sequences, plan_packs
from fsdptrain.rl.aggregate import LossNormalizers
from fsdptrain.rl.logprobs import chunked_logprobs_entropy, naive_logprobs_entropy
from fsdptrain.rl.fused_loss import PolicyLossSettings, SeqTargets
from fsdptrain.train.step import packed_policy_loss

METHODS = {"chunked": chunked_logprobs_entropy, "naive": naive_logprobs_entropy}
WARMUP_SEQS = 8


# ---------------------------------------------------------------------------------------------------------- memory


class _Clock:
    """Wall time and this process's CPU time since construction. On the shared machine the CPU time is the measure
    of the work (one thread per process); the wall time also counts the time other jobs held the cores."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        """(cpu_s, wall_s)."""
        return time.process_time() - self.cpu, time.perf_counter() - self.wall


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> str:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; say which peak measure is in use."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return "VmHWM (reset by /proc/self/clear_refs after the inputs were built)"
    except OSError:
        return "ru_maxrss (process lifetime peak; could not reset VmHWM)"


def _peak_rss_kib(measure: str) -> int:
    if measure.startswith("VmHWM"):
        return _read_status_kib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _build_inputs(num_tokens, vocab, hidden, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden_TH = torch.randn(num_tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) / hidden**0.5).requires_grad_()
    targets_T = torch.randint(vocab, (num_tokens,), generator=gen)
    coef_T = torch.randn(num_tokens, generator=gen)  # upstream gradient with both signs, like advantages
    return hidden_TH, weight_VH, targets_T, coef_T


def _loss(fn, hidden_TH, weight_VH, targets_T, coef_T, *, entropy, chunk_size):
    kwargs = {"compute_entropy": entropy}
    if fn is chunked_logprobs_entropy:
        kwargs["chunk_size"] = chunk_size
    logprobs_T, entropy_T = fn(hidden_TH, weight_VH, targets_T, **kwargs)
    loss = (logprobs_T * coef_T).sum()
    if entropy:
        loss = loss - 0.01 * entropy_T.sum()
    return loss


def _worker_memory_and_time(args) -> dict:
    fn = METHODS[args.method]
    hidden_TH, weight_VH, targets_T, coef_T = _build_inputs(args.tokens, args.vocab, args.hidden, args.seed)
    def step():
        return _loss(fn, hidden_TH, weight_VH, targets_T, coef_T, entropy=args.entropy, chunk_size=args.chunk_size)
    gc.collect()
    measure = _reset_peak_rss()
    base_kib = _read_status_kib("VmRSS")
    clock = _Clock()
    step().backward()
    peak_kib = _peak_rss_kib(measure)
    # The first run counts among the timed ones: every run allocates (and page-faults) its buffers afresh, the first
    # no more than the others, so the peak run is one more sample for the minimum.
    fwd_bwd, fwd_s = [clock.read()], []
    for _ in range(args.repeats):
        hidden_TH.grad = weight_VH.grad = None
        clock = _Clock()
        step().backward()
        fwd_bwd.append(clock.read())
    for _ in range(0 if args.skip_forward else args.repeats):
        with torch.no_grad():
            start = time.perf_counter()
            step()
            fwd_s.append(time.perf_counter() - start)
    return {
        "measure": measure,
        "base_mib": base_kib / 1024,
        "extra_mib": (peak_kib - base_kib) / 1024,
        "fwd_bwd_s": min(wall for _, wall in fwd_bwd),
        "fwd_bwd_cpu_s": min(cpu for cpu, _ in fwd_bwd),
        "fwd_s": min(fwd_s) if fwd_s else None,
    }


# ---------------------------------------------------------------------------------------------------------- packed


def lognormal_lengths(num_seqs: int, mean: float, seed: int, sigma: float = 0.6) -> list[int]:
    """Sequence lengths ~ LogNormal(mu, sigma) with E = exp(mu + sigma^2 / 2) = mean, at least 2 tokens each."""
    gen = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2
    draws = torch.exp(mu + sigma * torch.randn(num_seqs, generator=gen, dtype=torch.float64))
    return [max(2, round(float(x))) for x in draws]


def _packed_variants(model, prompts, responses, targets, *, token_budget, chunk_size, num_seqs=None):
    """name -> a callable giving one step's total loss to backward, on the same model and sequences.

    fused: `fsdptrain.train.step.packed_policy_loss` over packs planned under `token_budget` (one packed forward per
    pack, the chunked projection, the loss computed once per row); per-sequence: the reference path
    `per_sequence_policy_loss`, one forward per sequence through the unpacked model, full logits, a Python loop.
    `num_seqs`: only the first ones (the warm-up's subset).
    """
    if num_seqs is not None:
        prompts, responses, targets = prompts[:num_seqs], responses[:num_seqs], targets[:num_seqs]
    num_tokens = sum(len(r) for r in responses)
    norms = LossNormalizers(global_num_tokens=num_tokens, global_num_seqs=len(responses), dp_size=1,
                            loss_scale_factor=None)
    settings = PolicyLossSettings(agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                  seq_level_ratio=False, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.01,
                                  temperature=1.0, chunk_size=chunk_size)
    plan = plan_packs([len(p) + len(r) for p, r in zip(prompts, responses)], token_budget)

    def fused():
        total = 0.0
        for pack in plan.packs:
            packed = pack_sequences(prompts, responses, pack)
            loss, _ = packed_policy_loss(model, packed, [targets[i] for i in pack], norms=norms, settings=settings)
            total = total + loss
        return total

    def per_sequence():
        return per_sequence_policy_loss(model, prompts, responses, targets, norms=norms, settings=settings)[0]

    return {"fused packed": fused, "per-sequence loop": per_sequence}, plan.num_packs


def _benchmark_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdptrain.model.attention_switch import set_attention

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    set_attention(model, "sdpa_segments")
    return model


def _worker_packed(args) -> dict:
    lengths = lognormal_lengths(args.num_seqs, args.mean_len, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts, responses, targets = [], [], []
    for length in lengths:
        num_prompt = max(1, length // 4)
        ids = torch.randint(0, args.vocab, (length,), generator=gen).tolist()
        prompts.append(ids[:num_prompt])
        responses.append(ids[num_prompt:])
        num_response = length - num_prompt
        targets.append(SeqTargets(old_logprobs=-10.0 + torch.randn(num_response, generator=gen) * 0.1,
                                  advantages=torch.randn(num_response, generator=gen)))
    model = _benchmark_model(args)
    variants, num_packs = _packed_variants(model, prompts, responses, targets, token_budget=args.token_budget,
                                           chunk_size=args.chunk_size)
    # Warm-up on the first WARMUP_SEQS sequences only: it runs every code path once (the per-sequence loop over 64
    # sequences is most of the section's time, and its warm-up would double it).
    warmups, _ = _packed_variants(model, prompts, responses, targets, token_budget=args.token_budget,
                                  chunk_size=args.chunk_size, num_seqs=WARMUP_SEQS)
    times, cpu_times = {}, {}
    for name, step in variants.items():
        warmups[name]().backward()
        samples = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            clock = _Clock()
            step().backward()
            samples.append(clock.read())
        times[name] = min(wall for _, wall in samples)
        cpu_times[name] = min(cpu for cpu, _ in samples)
    return {"num_tokens": sum(lengths), "max_len": max(lengths), "num_packs": num_packs, "times_s": times,
            "cpu_times_s": cpu_times}


# ---------------------------------------------------------------------------------------------------------- driver


def _run_worker(args, kind: str, **overrides) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind]
    for key, value in {**vars(args), **overrides}.items():
        if key in ("worker", "sections") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker {kind} {overrides} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section_memory_and_timing(args) -> bool:
    print("\n== memory and time: forward+backward from hidden states, chunked vs naive, each in its own process ==")
    gib_logits = args.tokens * args.vocab * 4 / 2**30
    print(f"fp32 logits [T, V] alone: {gib_logits:.2f} GiB")
    all_pass = True
    for entropy in (False, True):
        label = "log-probs + entropy" if entropy else "log-probs only (the issue's naive: log_softmax + gather)"
        results = {m: _run_worker(args, "memory", method=m, entropy=entropy) for m in ("naive", "chunked")}
        naive, chunked = results["naive"], results["chunked"]
        ratio = chunked["extra_mib"] / naive["extra_mib"]
        ok = ratio <= 0.25
        all_pass &= ok
        print(f"\n-- {label}")
        print(f"peak measure: {chunked['measure']}")
        for name, res in results.items():
            print(f"{name:>8}: extra peak RSS {res['extra_mib']:8.1f} MiB (inputs built: {res['base_mib']:.0f} MiB)"
                  f" | fwd+bwd {res['fwd_bwd_s']:.3f} s ({res['fwd_bwd_cpu_s']:.3f} s CPU) | fwd no_grad "
                  f"{res['fwd_s']:.3f} s")
        print(f"memory ratio chunked/naive = {ratio:.3f} (goal <= 0.25): {'PASS' if ok else 'FAIL'}")
        print(f"time ratio chunked/naive: fwd+bwd {chunked['fwd_bwd_s'] / naive['fwd_bwd_s']:.2f}, "
              f"fwd {chunked['fwd_s'] / naive['fwd_s']:.2f}")
    return all_pass


def _section_packed(args) -> bool:
    print(f"\n== the fused packed policy loss vs the per-sequence loop: a {args.layers}-layer Llama, hidden {args.hidden}, "
          f"V={args.vocab}, forward + loss + backward ==")
    all_pass = True
    for num_seqs in (8, 64):
        res = _run_worker(args, "packed", num_seqs=num_seqs)
        times = res["times_s"]
        fused = times["fused packed"]
        print(f"\n-- {num_seqs} sequences, {res['num_tokens']} tokens (longest {res['max_len']}), "
              f"{res['num_packs']} pack(s) under a budget of {args.token_budget}")
        for name, seconds in times.items():
            print(f"{name:>18}: fwd+bwd {seconds:.3f} s   time / fused = {seconds / fused:.2f}")
        ok = fused <= times["per-sequence loop"]
        all_pass &= ok
        print(f"fused never slower than the per-sequence loop: {'PASS' if ok else 'FAIL'}")
    return all_pass


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=LossConfig.logprob_chunk_size,
                        help="tokens per chunk (default: the trainer's loss.logprob_chunk_size)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (the best is reported)")
    parser.add_argument("--mean-len", type=float, default=128.0, help="mean of the log-normal sequence lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker (1: steadiest here)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the packed section's model")
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens per pack in the packed section")
    parser.add_argument("--sections", default="memory,packed", help="comma list of: memory (includes timing), packed")
    parser.add_argument("--worker", choices=["memory", "packed"], help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=sorted(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--entropy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-seqs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--skip-forward", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker == "memory":
        print(json.dumps(_worker_memory_and_time(args)))
        return 0
    if args.worker == "packed":
        print(json.dumps(_worker_packed(args)))
        return 0
    print("benchmarks/loss.py settings:")
    print(f"  T={args.tokens} V={args.vocab} H={args.hidden} dtype=float32 chunk_size={args.chunk_size} "
          f"repeats={args.repeats} (best of, after a warm-up) seed={args.seed}")
    print(f"  packed: 8 and 64 sequences, log-normal lengths mean {args.mean_len:g}")
    print(f"  torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} (times are only as good as the machine is quiet)")
    sections = set(args.sections.split(","))
    unknown = sections - {"memory", "packed"}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from memory, packed")
    ok = True
    if "memory" in sections:
        ok &= _section_memory_and_timing(args)
    if "packed" in sections:
        ok &= _section_packed(args)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    print(f"overall: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
