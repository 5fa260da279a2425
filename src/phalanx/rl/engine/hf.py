"""A generation engine over any ``transformers`` causal LM, with its own KV-cached sampling loop.

``HFEngine.generate`` batches every prompt x sample into one batch of
``len(prompts) * n`` rows, left-padded to the longest prompt, runs one prefill
forward and then one single-token forward per new token, reusing the model's
``past_key_values``. Position ids are counted from each row's first real token,
so a left-padded row sees exactly the positions it would see alone; the padding
is masked out of attention. A row that samples EOS is finished: it keeps
feeding PAD (masked, discarded) until every row is finished or
``max_new_tokens`` is reached.

We write the loop ourselves rather than call ``model.generate`` because the
trainer's importance ratio needs the exact log-prob of each sampled token under
the distribution it was drawn from (see ``engine/base.py``), and because it is
the reference a faster engine (vLLM) is checked against.

In-flight weight updates
------------------------
``generate(..., between=hook)`` calls ``hook()`` after every ``chunk`` sampled
tokens (never after the last). When the hook loaded new weights (the engine's
``version`` changed), the running batch goes on under them, and the KV cache
is *recomputed* (``recompute_kv_on_update``, the default): prompt and tokens
generated so far are prefilled again with the new weights, so every later
token is drawn from exactly ``pi_{v_new}(. | prefix)`` and its recorded
log-prob is the one the trainer computes under version ``v_new`` (and each
earlier token's the one under its own version). The cost is one prefill of
``prompt + generated`` for the running batch per update: with the tests' tiny
model on one CPU thread, 64 rows of 70 tokens take about as long as 16 decode
steps, some 13% of a 128-token generation (docs/architecture.md, "Weight
sync").

With ``recompute_kv_on_update = False`` the cache is kept, as in PipelineRL
(Piche et al. 2025) and AReaL (Fu et al. 2025): the prefix's keys and values
stay those of the old weights, and the later tokens come from the new weights
applied over them. Their recorded log-probs are still the ones they were
sampled with (so the importance ratio against the behaviour distribution is
exact), but that distribution is neither version's policy: no trainer
forward pass reproduces it.

A load that fails part-way leaves the engine at version -1 (see
:meth:`HFEngine.load_weights`); a generation whose hook left it there raises
EngineError rather than go on sampling from mixed weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from phalanx.rl.engine.base import (
    Completion,
    GenerationEngine,
    Weights,
    call_between,
    check_args,
    check_names,
)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of shape ``[len(prompts), longest]``, real tokens right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


class HFEngine(GenerationEngine):
    """Samples from ``model`` (a ``transformers`` causal LM) with a KV cache.

    The engine owns its RNG (``seed``), so the same weights, prompts and seed
    give the same completions; with sampling ``keys`` (see the engine interface)
    each completion depends on its prompt's key alone. The model is put in eval mode and used under
    ``torch.no_grad``; pass a copy when the trainer keeps training the original
    (the single-process loop does, and syncs it with :meth:`load_weights`).
    ``chunk`` is how many tokens are sampled between two calls of a ``between``
    hook; ``recompute_kv_on_update`` whether an update mid-generation prefills
    the running batch again (see "In-flight weight updates").
    """

    inflight_updates = True

    def __init__(
        self,
        model: Any,
        eos_id: int,
        pad_id: int,
        seed: int = 0,
        version: int = -1,
        chunk: int = 8,
        recompute_kv_on_update: bool = True,
    ):
        if chunk < 1:
            raise ValueError(
                f"chunk must be >= 1 token between in-flight update points: got {chunk}. "
                f"Set rl.engine.chunk to a positive token count."
            )
        self.model = model.eval()
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.device = next(model.parameters()).device
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)
        self.version = version
        self.chunk = int(chunk)
        self.recompute_kv_on_update = bool(recompute_kv_on_update)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        keys: Sequence[int] | None = None,
        between: Callable[[], None] | None = None,
    ) -> list[Completion]:
        check_args(prompts, n, max_new_tokens, temperature, keys)
        rows = [list(p) for p in prompts for _ in range(n)]
        ids, mask = left_pad(rows, self.pad_id, self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        b = ids.shape[0]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        toks: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        versions: list[int] = []  # the version each step's tokens were drawn from
        noise = None
        if keys is not None and temperature > 0:
            noise = _uniforms(keys, n, max_new_tokens).to(self.device)
        for t in range(max_new_tokens):
            tok, lp = self._sample(
                logits.float(), temperature, None if noise is None else noise[:, t]
            )
            # Finished rows emit PAD with log-prob 0; both are dropped below.
            tok = tok.masked_fill(done, self.pad_id)
            toks.append(tok)
            lps.append(lp.masked_fill(done, 0.0))
            versions.append(self.version)
            done = done | (tok == self.eos_id)
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], 1)
            pos = pos[:, -1:] + 1
            updated = (
                between is not None and (t + 1) % self.chunk == 0 and call_between(self, between)
            )
            if updated and self.recompute_kv_on_update:
                # The whole sequence again under the new weights: prompt + tokens so far.
                seq = torch.cat([ids, torch.stack(toks, 1)], 1)
                full = (mask.cumsum(-1) - 1).clamp(min=0)
                out = self.model(
                    input_ids=seq, attention_mask=mask, position_ids=full, use_cache=True
                )
            else:
                out = self.model(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=past,
                    use_cache=True,
                )
            past, logits = out.past_key_values, out.logits[:, -1, :]
        return self._completions(rows, n, torch.stack(toks, 1), torch.stack(lps, 1), versions)

    def _sample(
        self, logits: torch.Tensor, temperature: float, uniform: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if temperature == 0:
            tok = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1)
        else:
            logp = torch.log_softmax(logits / temperature, -1)
            if uniform is None:
                tok = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(1)
            else:  # inverse CDF: one keyed uniform per row and token
                cdf = logp.double().exp().cumsum(-1)
                u = uniform[:, None] * cdf[:, -1:]
                tok = torch.searchsorted(cdf, u, right=True).squeeze(1)
                tok = tok.clamp_(max=logp.shape[-1] - 1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)

    def _completions(
        self,
        rows: list[list[int]],
        n: int,
        toks: torch.Tensor,
        lps: torch.Tensor,
        versions: list[int],
    ) -> list[Completion]:
        toks_l, lps_l = toks.tolist(), lps.tolist()
        result = []
        for i, row in enumerate(rows):
            seq = toks_l[i]
            end = seq.index(self.eos_id) + 1 if self.eos_id in seq else len(seq)
            own = versions[:end]
            result.append(
                Completion(
                    prompt_index=i // n,
                    prompt_ids=row,
                    token_ids=seq[:end],
                    logprobs=lps_l[i][:end],
                    finished=self.eos_id in seq,
                    version=own[0],
                    # Only a completion that spans an update lists its tokens' versions.
                    versions=own if own[0] != own[-1] else [],
                )
            )
        return result

    def layout(self) -> Mapping[str, torch.Tensor]:
        return self.model.state_dict()

    @torch.no_grad()
    def load_weights(self, weights: Weights, version: int) -> None:
        """See :meth:`GenerationEngine.load_weights`. Never mixed weights under a version:
        once the first tensor is copied the engine holds version -1 until the last one
        is, so a load that fails part-way (a stream cut off, a bad name late in it)
        leaves it at -1, and one that fails before copying anything keeps the old
        version, whose weights are then intact."""
        own = self.model.state_dict()
        if isinstance(weights, Mapping):
            check_names(own, weights.items())
            missing = sorted(set(own) - set(weights))
            if missing:
                raise ValueError(
                    f"weights must be a full state dict when given as a mapping: got "
                    f"{len(weights)} tensors, missing {missing[:5]}. Send every tensor, or "
                    f"stream a partial update as (name, tensor) pairs."
                )
            pairs: Any = weights.items()
        else:
            pairs = weights
        for name, tensor in pairs:
            check_names(own, [(name, tensor)])
            self.version = -1
            own[name].copy_(tensor)
        self.version = int(version)


def _uniforms(keys: Sequence[int], n: int, steps: int) -> torch.Tensor:
    """Uniforms in [0, 1) of shape (len(keys) * n, steps), prompt-major: one per
    sampled token. Each prompt's block comes from a generator seeded with its key,
    so token t of sample j of prompt i depends on (keys[i], j, steps) only. Drawn
    on CPU in float64: the same values on any device."""
    out = torch.empty((len(keys), n, steps), dtype=torch.float64)
    g = torch.Generator()
    for i, key in enumerate(keys):
        g.manual_seed(int(key) & (2**63 - 1))
        out[i].uniform_(generator=g)
    return out.view(-1, steps)
