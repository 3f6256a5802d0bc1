"""The training loop: experience, the FSDP2 update step, optimizers, the run directory and progress output.

The only part that joins models, collectives and numerics (docs/architecture.md).
"""
