"""`fsdptrain check-metrics`: the loss, the gradients and every metric compared across layouts against an oracle
computed straight from the definitions (docs/check-metrics.md)."""
