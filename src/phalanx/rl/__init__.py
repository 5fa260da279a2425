"""RL post-training (GRPO): the algorithm, with no process loop of its own.

- ``base.py``      the Tokenizer and Task interfaces
- ``tokenizer.py`` a character tokenizer for the built-in task, and local HF tokenizers
- ``model.py``     a tiny causal LM built with ``transformers`` from config, or a local path
- ``engine/``      generation engines (``GenerationEngine``); ``hf.py`` is a KV-cached sampler
- ``tasks.py``     the built-in sort task and JSONL prompts with a ``module:function`` reward
- ``grpo.py``      group advantages, the clipped token-normalised GRPO loss, the LR schedule
- ``generate.py``  generate and score the rollouts of a prompt lease
- ``trainer.py``   the GRPO step of a policy replica on its share of a batch
- ``sandbox/``     model-written code run in bubblewrap: ``run_python``, ``unit_test_score``

The loops that use them are in :mod:`phalanx.jobs` (``rl_policy``, ``rl_rollout``,
``rl_single``). Nothing heavy is imported here, so importing ``phalanx.rl`` stays cheap.
"""
