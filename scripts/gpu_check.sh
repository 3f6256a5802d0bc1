#!/usr/bin/env bash
# The checks that need a CUDA device, in one pass (CI has none; docs/attention-backends.md, "Checking the GPU backends
# on a CPU").
#
#     OUT=gpu-check bash scripts/gpu_check.sh
#
# Runs from the repository root with fsdptrain importable (installed, or PYTHONPATH=.), and writes one log per check
# under $OUT:
#   pytest_gpu.log  the tests marked gpu (the varlen kernels against the exact CPU fallback, shared prompts on
#                   flash_attn, FSDP2 on CUDA with CPU offload), plus the attention and shared-prompt test files whole
#   train.log       the embedded default, 30 steps, on CUDA (bf16 params where the default says so)
#   check.log       check-metrics on CUDA, with the packed attention backend the machine offers
#   attn_time.log   one packed row's attention forward+backward: the varlen kernel vs sdpa_segments (CUDA events)
# Each check runs even when one before it failed; the exit code is the number of failed checks.
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
failed=0

run() {  # run NAME COMMAND...: the command's output to $OUT/NAME.log; a failure is counted, not fatal
    local name=$1; shift
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__)'
  "$PY" -c 'from fsdptrain.model.attention_switch import available_backends; import torch
print("packed backends on cuda/bf16:", available_backends("cuda", torch.bfloat16))'
} >"$OUT/summary.txt" 2>&1

run pytest_gpu "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
    tests/unit/test_attention.py tests/unit/test_shared_prompts.py tests/dist/test_fsdp_models.py
run train "$PY" -m fsdptrain.cli train trainer.steps=30 trainer.device=cuda "trainer.run_dir=$OUT/run"
run check "$PY" -m fsdptrain.cli check-metrics trainer.device=cuda
run attn_time "$PY" scripts/gpu_attention_timing.py
exit "$failed"
