"""Rollouts: where a step's experience comes from (docs/architecture.md, "Rollout sources").

- rollout_source.py: what the train loop asks of a source (``RolloutSource``), ``build_source``;
- rollout_models.py: what rollouts read of the run's models (``RolloutModels``);
- prompt_source.py: prompt rows sampled by the policy through a sampler, scored by reward functions and models;
- sampler.py: the ``Sampler`` interface and what a sampler hands the source (``Samples``);
- single_turn.py: the single-turn sampler, one completion per sample;
- multi_turn.py: the multi-turn sampler, each sample a trajectory of turns with tools or an environment;
- turns.py: the one turn loop over a decoder and its caps (token-in/token-out on fsdptrain/data/conversation.py);
- evaluation.py: the greedy reward and the sampled evaluation (pass@k, mean@n, maj@n), single- and multi-turn;
- offline_source.py: rollouts read from a JSONL file;
- tools.py: the user's tools and environment, loaded, checked and called;
- scoring.py: the reward models' scores of a rank's samples.

Tokens come from fsdptrain/generation/ (its ``Decoder``); nothing here names an engine.
This package imports nothing at import time: reward worker processes load ``fsdptrain.rollout.tools`` by spec.
"""
