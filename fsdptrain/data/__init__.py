"""Data: sequence packing, the bundled tokenizer and tasks, rollouts and the files users bring.

Never imports a model, a collective or the loop (docs/architecture.md).
"""
