"""Models as transformers builds them: building from a config or a folder, packed attention backends, forwards.

Never imports a loss or torch.distributed; sharding is applied from outside by fsdptrain.distributed
(docs/architecture.md).
"""
