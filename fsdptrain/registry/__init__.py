"""The layer below both :mod:`fsdptrain.config` and :mod:`fsdptrain.rl`: what the config's validation and the numerics
must agree on, defined once.

- :mod:`.names`: the names users choose from (`loss.agg_mode`, `algorithm.kl_estimator`, ...).
- :mod:`.constants`: the numeric bounds that are both a config default and a numerics constant.
- :mod:`.user_functions`: loading a user's ``module:function`` or ``file.py:function`` and checking its signature.
- :mod:`.errors`: :class:`~fsdptrain.registry.errors.ConfigError` (a user's mistake: one line, exit 2).

Torch-free at import, and imports nothing of fsdptrain above it (tests/unit/test_import_direction.py), so the CLI's
parent process can validate a config before any rank starts. This ``__init__`` imports nothing.
"""
