"""Rollouts: where a step's experience comes from (docs/architecture.md, "Rollout sources").

- source.py: what the train loop asks of a source (``RolloutSource``), ``build_source``;
- prompt_source.py: prompt rows sampled by the policy through a sampler, scored by reward functions and models;
- samples.py: what a sampler hands the source (``Samples``) and the ``Sampler`` interface;
- single_turn.py: the single-turn sampler, one completion per sample;
- multi_turn.py: the multi-turn sampler, each sample a trajectory of turns with tools or an environment;
- evaluation.py: the greedy reward and the sampled evaluation (pass@k, mean@n, maj@n), single- and multi-turn;
- offline.py: rollouts read from a JSONL file;
- turns.py: the turn loop and its caps (token-in/token-out on fsdptrain/data/conversation.py's chat rendering);
- tools.py: the user's tools and environment, loaded, checked and called;
- scoring.py: the reward models' scores of a rank's samples;
- sampling.py: generation's set-up (the ``generation`` block) and the sampling seeds.

This package imports nothing at import time: reward worker processes load ``fsdptrain.rollout.tools`` by spec.
"""
