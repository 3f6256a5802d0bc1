"""Typed metrics (docs/metrics.md): each value carries how it reduces over packs, micro-batches and ranks
(typed.py), and the flat buffers one all-reduce carries (buffers.py). Pure torch; imports nothing of fsdptrain."""
