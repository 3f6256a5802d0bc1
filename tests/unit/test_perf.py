"""Phase timers and FLOP counts of fsdptrain/run/perf.py, with numbers worked out by hand."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from fsdptrain.metrics.typed import Kind, Max, finalize
from fsdptrain.run.perf import (
    StepTimer,
    forward_flops,
    generation_flops,
    matmul_params,
    peak_memory_bytes,
    peak_tflops,
    phase,
    throughput,
)

# hidden 4, 1 layer, 2 query heads of size 2, 1 kv head, MLP 8, vocab 10
CONFIG = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=8, vocab_size=10)


def test_matmul_params():
    # attention 4 * 2 * (2 * 2 + 2 * 1) = 48; MLP 3 * 4 * 8 = 96; head 4 * 10 = 40
    assert matmul_params(CONFIG) == 184


def test_forward_flops():
    # 2 * 184 * 3 + 2 * L(1) * H_q(2) * d(2) * 3^2 = 1104 + 72; sequences add up
    assert forward_flops(CONFIG, [3]) == 1176
    assert forward_flops(CONFIG, [3, 3]) == 2 * 1176


def test_generation_flops():
    # prompt of 2: 2 * 184 * 2 + 8 * 4 = 768; new token j against p + j + 1 cached keys: 368 + 16 * (3, then 4)
    assert generation_flops(CONFIG, [2], [2]) == 768 + (368 + 48) + (368 + 64)


def test_phases_add_up_and_do_not_nest():
    with StepTimer() as timer:
        with phase("generate"):
            time.sleep(0.02)
            with phase("reward"):
                time.sleep(0.3)
        with phase("update"):
            pass
    metrics = timer.timings()
    parts = [metrics[f"perf/{name}_s"] for name in ("generate", "reward", "experience", "update", "other")]
    assert metrics["perf/step_s"] == sum(parts)
    assert metrics["perf/step_s"] == pytest.approx(timer.total, abs=1e-9)
    assert metrics["perf/reward_s"] >= 0.3
    assert 0.02 <= metrics["perf/generate_s"] < 0.3  # the inner phase's time was taken out of the outer one
    assert metrics["perf/experience_s"] == 0.0


def test_phase_without_timer_is_a_no_op():
    with phase("generate"):
        pass


def test_cpu_has_no_peak_and_reports_rss():
    assert peak_tflops(None, torch.device("cpu")) is None
    assert peak_tflops(100.0, torch.device("cpu")) == 100.0
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20  # torch alone is more than 10 MiB


def test_every_perf_metric_is_a_diagnostic_max_with_the_plain_value():
    """A consumer tells a perf/* number from a compared one by its kind (docs/metrics.md), not by its name."""
    with StepTimer() as timer:
        with phase("generate"):
            time.sleep(0.01)
        with phase("update"):
            time.sleep(0.01)
    result = {"batch/num_response_tokens": 30.0, "batch/num_prompt_tokens": 10.0}
    perf = {**timer.metrics(), **throughput(timer.timings(), result=result, update_epochs=2, step_flops_local=4e9,
                                            peak=8.0, device=torch.device("cpu"), world_size=1)}
    names = {*timer.timings(), "perf/tokens_per_s", "perf/generated_tokens_per_s", "perf/trained_tokens_per_s",
             "perf/tflops_per_rank", "perf/mfu", "perf/peak_mem_gib"}
    assert set(perf) == names
    for name, metric in perf.items():
        assert metric.kind is Kind.DIAGNOSTIC and isinstance(metric.inner, Max), name
    values, timings = finalize(perf), timer.timings()
    assert {k: values[k] for k in timings} == timings  # exactly rank 0's seconds, so the phases still add up
    step_s = timings["perf/step_s"]
    assert values["perf/tokens_per_s"] == pytest.approx(40.0 / step_s, rel=1e-12)
    assert values["perf/trained_tokens_per_s"] == pytest.approx(80.0 / timings["perf/update_s"], rel=1e-12)
    assert values["perf/tflops_per_rank"] == pytest.approx(4e9 / step_s / 1e12, rel=1e-12)
    assert values["perf/mfu"] == pytest.approx(values["perf/tflops_per_rank"] / 8.0, rel=1e-12)
