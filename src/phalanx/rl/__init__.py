"""RL post-training (GRPO): tasks, tokenizers, generation engines and the loss.

The single-process core lives here; the elastic policy/rollout split builds on it:

- ``base.py``      the Tokenizer and Task interfaces
- ``tokenizer.py`` a character tokenizer for the built-in task, and local HF tokenizers
- ``model.py``     a tiny causal LM built with ``transformers`` from config, or a local path
- ``engine/``      generation engines (``GenerationEngine``); ``hf.py`` is a KV-cached sampler
- ``tasks.py``     the built-in sort task and JSONL prompts with a ``module:function`` reward
- ``grpo.py``      group advantages and the clipped, token-normalised GRPO loss
- ``single.py``    the single-process training loop (the baseline), ``python -m phalanx.rl.single``

Nothing heavy is imported here, so importing ``phalanx.rl`` stays cheap.
"""
