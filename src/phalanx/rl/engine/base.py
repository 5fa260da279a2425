"""The generation-engine interface: sample completions and record behaviour log-probs.

What "behaviour log-probs" means
--------------------------------
GRPO's clipped objective weighs each sampled token by the importance ratio
``pi_theta(a|s) / mu(a|s)``, where ``mu`` is the distribution the token was
*actually drawn from* (the behaviour policy: the weights of ``version`` at the
sampling temperature T). So ``Completion.logprobs[t]`` is
``log_softmax(logits / T)[token_t]`` computed by the engine at draw time, and
the trainer must evaluate ``pi_theta`` the same way (``grpo_loss(...,
temperature=T)``). Then, on the first optimizer step after a weight sync, the
ratio is exactly 1 up to kernel noise, and any departure measures genuine
staleness or an engine/trainer mismatch, never a temperature artefact. Mixing
a T != 1 sampler with T = 1 log-probs (or the reverse) would bias every ratio
and let the clip silently discard gradient.

Greedy decoding (``temperature == 0``) has a point-mass behaviour policy; the
engine then records ``log_softmax(logits)`` (T = 1) of the argmax for
diagnostics, and such rollouts are for evaluation, not for importance-weighted
training.

Sampling keys
-------------
``generate(..., keys=...)`` gives each prompt a sampling key: the ``j``-th
sample of prompt ``i`` is then drawn from a random stream fixed by
``(keys[i], j)`` alone, so a completion depends only on the weights, the
prompt and its key, never on the other prompts in the batch, the replica that
draws it, or how often the prompt was dispatched. Rollout replicas key each
prompt by :func:`prompt_key` of the job seed and the prompt's index, and the
single-process baseline does the same: a prompt dispatched again after its
replica died is regenerated exactly, and a run is reproducible whatever the
membership did.

Engines
-------
- ``hf.py``: :class:`~phalanx.rl.engine.hf.HFEngine`, a KV-cached sampling loop
  over any ``transformers`` causal LM. CPU and GPU.
- ``vllm.py``: :class:`~phalanx.rl.engine.vllm.VLLMEngine`, vLLM run in the
  replica's own process, one request per sample seeded with
  :func:`sample_seed`, ``logprobs_mode="processed_logprobs"`` (vLLM's default
  reports log-probs before temperature, which is not the behaviour policy when
  T != 1), weights reloaded in place.

In-flight weight updates
------------------------
An engine with ``inflight_updates = True`` takes a weight update in the middle
of a generation: ``generate(..., between=hook)`` calls ``hook()`` between decode
steps (the HF engine every ``chunk`` tokens), from the thread that called
``generate``; the hook may call :meth:`GenerationEngine.load_weights`, and
every token sampled after it is drawn from, and records the log-prob under,
the new weights. ``Completion.versions[t]`` is then the behaviour version of
``token_ids[t]`` (non-decreasing along a completion) and ``Completion.version``
the oldest of them, the first token's, so a staleness check on ``version``
measures the oldest token (PipelineRL, Piche et al. 2025; AReaL, Fu et al.
2025, interrupt generation the same way). An engine without the capability
never calls ``hook`` (or calls it only before the first token).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def prompt_key(seed: int, index: int) -> int:
    """The sampling key of prompt ``index`` in a job seeded with ``seed`` (63 bits)."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & (2**63 - 1)


class EngineError(RuntimeError):
    """An engine cannot serve this model or these options, or failed (a one-line reason)."""


def one_line(e: BaseException) -> str:
    """``e`` as one line of at most ~300 characters, its type first: for an EngineError
    that quotes an engine's own error."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def sample_seed(key: int, sample: int) -> int:
    """The seed of sample ``sample`` of the prompt keyed ``key`` (63 bits): engines that
    seed each sample on its own (vLLM) draw it from this."""
    return (key * 0xD6E8FEB86659FD93 + (sample + 1) * 0x9E3779B97F4A7C15) & (2**63 - 1)


Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""A full state dict, or a stream of (name, tensor) pairs that may cover part of the model."""


class Owned(Iterator[tuple[str, torch.Tensor]]):
    """A stream of (name, tensor) pairs whose tensors nobody writes again once they are
    yielded (a weight channel's fresh receive buffer, :func:`~phalanx.jobs.rl_rollout.
    fetch_into`): an engine may keep them as they are, with no copy, for as long as it
    needs them (vLLM's rollback copy of the version it holds: ``vllm_update.py``).
    Anything else handed to ``load_weights`` (a trainer's live parameters) is copied."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]):
        self._it = iter(pairs)

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._it)


@dataclass
class Completion:
    """One sampled completion of one prompt.

    ``token_ids`` holds the generated tokens only (not the prompt), EOS
    included when it was sampled, and nothing after it. ``logprobs[t]`` is the
    behaviour log-prob of ``token_ids[t]`` (see the module docstring), so the
    two have the same length.
    """

    prompt_index: int
    """Position of the prompt in the list given to ``generate``."""
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    """True when the completion ended with EOS; False when cut off by max_new_tokens."""
    version: int
    """Weights version that produced it: the oldest of ``versions`` when it spans several."""
    reward: float | None = None
    advantage: float | None = None
    info: dict = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    """Behaviour version of each token (same length as ``token_ids``, non-decreasing),
    or empty, meaning every token is at ``version``."""
    mask: list[int] = field(default_factory=list)
    """A multi-turn episode's: 1 for each token the model generated, 0 for the
    environment's (trained as context only; their ``logprobs`` are 0). Empty: every
    token is the model's."""

    def trained_tokens(self) -> int:
        """How many of ``token_ids`` the loss counts (the model's, by ``mask``)."""
        return sum(self.mask) if self.mask else len(self.token_ids)

    def token_versions(self) -> list[int]:
        """The behaviour version of each token (``versions``, or ``version`` repeated)."""
        return list(self.versions) if self.versions else [self.version] * len(self.token_ids)


class GenerationEngine(ABC):
    """Samples completions with the weights of ``version``.

    Single-caller: an engine is driven by one thread of one process (a rollout
    replica); ``generate`` and ``load_weights`` must not overlap.
    """

    version: int
    """Weights version currently loaded (the policy step that produced them); -1 before any load."""

    inflight_updates: bool = False
    """True when ``generate`` calls its ``between`` hook between decode steps, so a
    weight update can land during a generation (see "In-flight weight updates");
    a rollout replica declares the capability ``inflight_updates`` from this."""

    streamed_updates: bool = False
    """True when :meth:`load_weights` keeps its version on a stream that breaks part-way
    (it rolls back, or reads the whole stream before it writes anything): a rollout
    replica then feeds it a weight channel's stream (``WeightChannel.fetch_stream``),
    each tensor loaded as soon as it arrives. False (the HF engine: it copies each
    tensor into the live model, and a cut stream leaves it at version -1): the replica
    fetches the whole version first, so a broken transfer leaves its version whole."""

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        keys: Sequence[int] | None = None,
        between: Callable[[], None] | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions for each prompt (token ids, BOS included where used).

        Returns ``len(prompts) * n`` completions, prompt-major: the ``j``-th
        sample of prompt ``i`` is at ``i * n + j``. Each completion stops at its
        own EOS or after ``max_new_tokens`` tokens. ``temperature == 0`` is
        greedy. ``keys`` (one per prompt) makes each completion a function of
        its prompt's key (see "Sampling keys"); without them the engine's own
        seeded stream is used. Raises ValueError on empty prompts or arguments
        out of range.

        ``between``, on an engine with ``inflight_updates``, is called between
        decode steps (never after the last); it may load new weights, and the
        tokens sampled after it then carry the new version in
        ``Completion.versions``. With keys, the completions are a function of
        the keys, the weights and the steps at which the weights changed. An
        exception it raises ends the generation and propagates.
        """

    @abstractmethod
    def layout(self) -> Mapping[str, torch.Tensor]:
        """A tensor shaped like each weight this engine takes, by HF name (the names of
        the policy's ``state_dict``): what a weight channel checks a sync against and
        receives into. May be meta tensors (layout only)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Free what the engine holds (a vLLM engine's worker and KV cache)."""

    @abstractmethod
    def load_weights(self, weights: Weights, version: int) -> None:
        """Copy ``weights`` into the engine's model and set ``self.version = version``.

        A Mapping must be a full state dict (every parameter present); an
        iterable of pairs may cover part of the model (streamed in chunks).
        Unknown names and shape mismatches raise ValueError before anything is
        copied from a Mapping; for a stream, the version is only advanced once
        the whole stream was applied.
        """


def check_names(own: Mapping[str, torch.Tensor], pairs: Any) -> None:
    """ValueError unless every (name, tensor) of ``pairs`` has a name and shape of ``own``."""
    for name, tensor in pairs:
        if name not in own:
            raise ValueError(
                f"weight name must be one of the engine model's: got {name!r}, which it does "
                f"not have. The sender's model must have the engine's architecture."
            )
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"weight {name} must have the engine's shape: got {tuple(tensor.shape)}, "
                f"expected {tuple(own[name].shape)}. The sender's model config differs."
            )


def check_args(
    prompts: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    keys: Sequence[int] | None = None,
) -> None:
    """ValueError naming what is wrong with ``generate``'s arguments."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            f"prompts must be a non-empty list of non-empty token lists: got "
            f"{len(prompts)} prompts, lengths {[len(p) for p in prompts][:8]}. Encode each "
            f"prompt with the tokenizer (which adds BOS) before generating."
        )
    if n < 1 or max_new_tokens < 1:
        raise ValueError(
            f"n and max_new_tokens must be >= 1: got n={n}, max_new_tokens={max_new_tokens}."
        )
    if not 0 <= temperature <= 100:
        raise ValueError(
            f"temperature must be in [0, 100]: got {temperature}. Use 0 for greedy decoding."
        )
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(
            f"keys must hold one sampling key per prompt: got {len(keys)} keys for "
            f"{len(prompts)} prompts. Use prompt_key(seed, index) for each prompt."
        )


def call_between(engine: GenerationEngine, between: Callable[[], None]) -> bool:
    """Run a ``between`` hook for ``engine``'s generation; True when it loaded another
    version. A hook that left the engine without whole weights (a load failed part-way:
    version -1) ends the generation with EngineError: what it would sample next comes
    from no version at all."""
    before = engine.version
    between()
    if engine.version < 0 <= before:
        raise EngineError(
            f"a weight update during generation failed part-way (the engine held "
            f"version {before}): the batch is abandoned, as its next tokens would come "
            f"from mixed weights. Sync again before generating."
        )
    return engine.version != before
