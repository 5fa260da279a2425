"""The model spec both halves of the product share: ``[rl.model]`` for the RL
policy and its rollouts, ``[train.model]`` for FT-DDP, HSDP and DiLoCo jobs.

A local Hugging Face causal-LM directory (``path``: any architecture
``transformers`` has a ``*ForCausalLM`` for, loaded with ``local_files_only``), or,
for tests and the RL demo, a tiny one built from the fields below.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """The policy model: a tiny random causal LM from config, or a local checkpoint."""

    path: str | None = None
    """Local directory of a saved HF model (``save_pretrained``). None: build from the fields below."""
    arch: Literal["gpt2", "llama"] = "gpt2"
    """Architecture of a model built from config. gpt2's learned absolute positions let a
    2-layer model place EOS after exactly N tokens early in RL; llama (RoPE only) must
    learn to count first and, on the sort task, tends to suppress EOS for good."""
    hidden_size: int = Field(64, ge=8, le=1 << 16)
    num_layers: int = Field(2, ge=1, le=256)
    num_heads: int = Field(4, ge=1, le=256)
    intermediate_size: int = Field(192, ge=8, le=1 << 18)
    """MLP width (llama); gpt2 uses 4 x hidden_size."""
    max_positions: int = Field(64, ge=8, le=1 << 20)
    """Longest prompt + completion, in tokens."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection."""
    attn_implementation: Literal["eager", "sdpa"] = "eager"
    """HF attention kernel. eager is the quickest for tiny models on CPU."""
    seed: int = Field(0, ge=0)
    """Seed of the random init: the same seed gives the same weights."""

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size must be divisible by model.num_heads: got hidden_size="
                f"{self.hidden_size}, num_heads={self.num_heads}. Pick num_heads among the "
                f"divisors of hidden_size."
            )
        return self


class LoraSection(_Section):
    """LoRA (Hu et al. 2021, arXiv:2106.09685) on the model: ``[rl.lora]`` or
    ``[train.lora]``. The base model is frozen and rebuilt from the model spec on
    every process (the same seed or the same directory), so only the adapter (its A
    and B matrices) is trained, all-reduced, healed, checkpointed and synced. Absent:
    the whole model is trained."""

    r: int = Field(16, ge=1, le=4096)
    """Rank of each adapter: A is r x in, B is out x r."""
    alpha: int = Field(32, ge=1, le=1 << 20)
    """Scale numerator: the update is (alpha / r) B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input. Keep 0 for RL: the importance ratio compares the
    trainer's forward with the engine's, which has none."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["c_attn", "q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        max_length=256,
    )
    """Module-name suffixes the adapters wrap (peft's meaning: ``q_proj`` wraps every
    module whose name ends in ``.q_proj``). The default covers gpt2's and llama's
    attention; a list none of whose names the model has is refused, naming its
    linear modules."""

    @model_validator(mode="after")
    def _names(self) -> LoraSection:
        bad = [m for m in self.target_modules if not m.strip() or m != m.strip()]
        if bad:
            raise ValueError(
                f"lora.target_modules must be module names without spaces: got {bad!r}. "
                f"Name modules as the model does, e.g. q_proj or c_attn."
            )
        return self
