"""verl's `DataProto`, as far as the parity tests read it: a holder of named tensors (`.batch`, `.meta_info`)."""

from __future__ import annotations


class DataProto:
    def __init__(self, batch=None, meta_info=None):
        self.batch = dict(batch or {})
        self.meta_info = dict(meta_info or {})

    @classmethod
    def from_dict(cls, tensors=None, meta_info=None):
        return cls(tensors, meta_info)
