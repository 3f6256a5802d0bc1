"""Shared test helpers (not tests): what tests/unit, tests/dist, tests/e2e and benchmarks/ import.

- attention_call_counts: counts the packed attention backends' calls through transformers' AttentionInterface.
- chatml_tokenizer: a character-level tokenizer with a ChatML chat template (tools, think-stripping variants).
- digit_tasks_oracle: the original digit tasks, an independent oracle for the prompt-task rows and their reward.
- planted_bugs: bugs from the anchors' trainers, planted into the product for check-metrics' tests to catch.
- reward_model_folders: tiny Llama / Qwen2 reward-model folders with a character-level tokenizer.
- teacher_folders: tiny distillation teachers saved with save_pretrained.
- tiny_gguf: a tiny Llama written as a GGUF file, the way llama.cpp's converter writes one.
- tiny_llama: a seeded tiny random LlamaForCausalLM, the one many tests build.
- varlen_kernel_standins: CPU stand-ins for the varlen attention kernels, written from their documentation.
"""
