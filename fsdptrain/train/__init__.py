"""The recipes (RL and SFT) and what they train: set-up from the config, experience, the FSDP2 update step,
optimizers, the co-trained drafter. The run flow they share (run directory, checkpoints, progress) is fsdptrain/run/
(docs/architecture.md).
"""
