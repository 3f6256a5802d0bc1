"""Everything that spans processes: the process group and mesh, FSDP2 wrapping, checkpoints and export.

Never imports a loss or the loop (docs/architecture.md).
"""
