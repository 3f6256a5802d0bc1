"""Generation: everything that turns prompt ids into sampled tokens, behind one seam (docs/architecture.md, "The
generation room and its seam").

- decoder.py: the seam: ``Decoder``, its ``Request`` / ``Generated`` records, ``Sampling``, the ``recording`` hook;
- engines.py: the decoder ``rollout.engine`` names (``make_decoder``);
- continuous.py: the continuous engine (``ContinuousEngine``: admission, the decode loop) and its decoder;
- kv_cache.py: its padded batch cache and the caches a row keeps between turns (``KeptCache``);
- shared_prefix.py: its attention over a group's prompt held once (``SHARED_PREFIX_ATTENTION``);
- row_sampling.py: row-seeded sampling, the same draw in both engines (``sample_rows``, ``RowSeededSampling``);
- generate.py: transformers' ``generate`` (``generate_responses``) and its decoder;
- block.py: the block every decoder runs in (``generation``); gather.py: FSDP2 weights gathered for it;
- seeds.py: every sampling seed, with the table of what each depends on.
"""
