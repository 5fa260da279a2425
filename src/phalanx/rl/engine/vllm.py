"""A generation engine over vLLM, with the contract of :class:`~phalanx.rl.engine.hf.HFEngine`.

How it runs
-----------
vLLM runs inside the rollout replica's own process: one worker
(``distributed_executor_backend="uni"``) and no engine-core subprocess
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). A weight update then goes from the
buffers the weight channel received into (a gloo broadcast, or a snapshot
read from storage) straight into vLLM's parameters, through
``collective_rpc`` into :class:`~phalanx.rl.engine.vllm_worker.WorkerExtension`:
no second process, no serialization, no file. If vLLM dies, the replica dies
with it and is restarted like any other; its leased prompts go out again.

Sampling
--------
Every sample is its own request with ``n = 1`` and a per-request seed,
:func:`~phalanx.rl.engine.base.sample_seed` of the prompt's key and the
sample's index. A prompt dispatched again therefore draws the same random
numbers. The tokens also depend on the logits, which vLLM computes in a
batch whose composition varies: docs/architecture.md ("vLLM rollout
replicas") gives how often that changes a token, as measured. Log-probs are
vLLM's ``processed_logprobs`` (after temperature): the behaviour policy, as
``engine/base.py`` requires. Generation stops at EOS (a stop token,
included in the completion) or after ``max_new_tokens``.

Weights
-------
:meth:`VLLMEngine.load_weights` checks every name and shape against the
model's before anything is copied, then reloads in place and drops the
prefix cache (its keys and values were computed with the old weights). A
reload that fails part-way leaves the engine at version -1, which gets no
prompts until a sync succeeds: it never generates with mixed weights.

In-flight weight updates
------------------------
``generate(..., between=hook)`` drives vLLM's engine one step at a time, as
``LLM.generate`` does inside (``LLM.enqueue``, then ``LLMEngine.step`` until
no request is left), and calls ``hook()`` after every ``chunk`` steps while
requests remain. A step samples one token of every running request, so the
hook runs every ``chunk`` tokens, as in the HF engine (a request vLLM admits
later, when the batch exceeds its ``max_num_seqs``, has fewer tokens at the
first hook; its versions are recorded all the same). When the hook loads
new weights, the running requests go on; they are neither aborted nor
restarted. Their KV cache is **recomputed**: ``load_weights`` calls
``reset_prefix_cache(reset_running_requests=True)``, which preempts every
running request (vLLM's preemption by recompute) and frees its blocks, so
the next step prefills prompt + tokens so far under the new weights and
samples the next token from them. Each token after the update is therefore
drawn from exactly ``pi_new(. | prefix)``, and its recorded log-prob is the
one the trainer computes under its own version (the test checks it against
``grpo.token_logprobs``). Keeping the stale cache instead, as PipelineRL
(Piche et al. 2025) does, would sample later tokens from a mix of the two
versions that no trainer forward reproduces (on the test model their
log-probs were 0.42 off the new version's); ``rl.engine.recompute_kv_on_update
= false`` is therefore refused. A request keeps its seeded generator across the
preemption (the model runner keeps its state), so with the same keys and
the same update step the completions are reproducible. The cost is one
prefill of prompt + tokens so far per update: on the test model about two
decode steps, and with the reload about 4 % of a 32-token generation
(docs/architecture.md, "vLLM rollout replicas", gives the measurement).

Each token's version is vLLM's own record: the engine core labels every
step's output with ``set_weight_version`` (set from :attr:`version` before
the first step and after every hook), and a finished request carries
``weight_versions`` spans, which become ``Completion.versions``.

Scheduling is synchronous (``async_scheduling=False``; vLLM's GPU default is
asynchronous): with an asynchronous batch queue a batch may still be in
flight when ``step`` returns, and a reload between two steps would race it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from phalanx.config.rl import EngineSection
from phalanx.rl.engine.base import (
    Completion,
    EngineError,
    GenerationEngine,
    Weights,
    call_between,
    check_args,
    check_names,
    one_line,
    sample_seed,
)
from phalanx.rl.engine.vllm_update import UpdateFailed, WeightUpdater

log = logging.getLogger("phalanx.rl.engine.vllm")

EXTENSION = "phalanx.rl.engine.vllm_worker.WorkerExtension"


def _prepare_env() -> None:
    """vLLM's settings that must be in the environment before it is imported."""
    # One process: the engine core and its worker run here (see the module docstring).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Several replicas may share a host's cores: no pinning unless the operator asks.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # stdout carries the replica's JSON events; vLLM's log goes with the rest, to stderr.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def check_model_dir(path: str | Path, device: str, tp: int = 1) -> dict[str, Any]:
    """The HF config of the causal LM saved in ``path``, or EngineError saying why vLLM
    cannot serve it (not a model directory, not a causal LM, an architecture vLLM lacks,
    a head size vLLM's CPU attention lacks, a tensor-parallel degree ``tp`` that does
    not split its heads or vocabulary)."""
    p = Path(path)
    cfg_file = p / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(
            f"the vLLM engine needs a model directory with a config.json: {cfg_file} "
            f"could not be read ({one_line(e)}). Point model.path at a save_pretrained "
            f"directory."
        ) from e
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not any(
        isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs
    ):
        raise EngineError(
            f"the model in {p} must be a causal LM: its architectures are {archs!r}. Save a "
            f"*ForCausalLM model (AutoModelForCausalLM) there."
        )
    _prepare_env()
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise EngineError(
            f"vLLM does not support the architecture of the model in {p}: {archs!r}. Use "
            f'rl.engine.kind = "hf", or a model vLLM lists (Llama, Qwen2, GPT2, ...).'
        )
    check_tp_split(cfg, tp, p)
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 0)
        hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
        head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise EngineError(
                f"vLLM's CPU attention does not support the head size of the model in {p}: "
                f"{head_dim} (hidden {hidden} / {heads} heads). Supported: {sizes}; change "
                f'model.num_heads or model.hidden_size, or use rl.engine.kind = "hf".'
            )
    return cfg


def check_tp_split(cfg: Mapping[str, Any], tp: int, where: Path) -> None:
    """EngineError unless ``tp`` ranks split the model of HF config ``cfg`` evenly: each
    rank takes heads / tp attention heads, kv_heads / tp KV heads (or one KV head
    replicated, when tp is a multiple of kv_heads, as vLLM does) and vocab / tp rows of
    the embedding and the LM head."""
    if tp == 1:
        return
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 0)
    kv = int(cfg.get("num_key_value_heads") or heads)
    vocab = int(cfg.get("vocab_size") or 0)
    bad = [
        f"{what} {n}"
        for what, n, ok in (
            ("attention heads", heads, heads % tp == 0),
            ("KV heads", kv, kv % tp == 0 or tp % kv == 0),
            ("vocabulary", vocab, vocab % tp == 0),
        )
        if not ok
    ]
    if bad:
        raise EngineError(
            f"rl.engine.tensor_parallel_size must divide the model's attention heads, KV "
            f"heads and vocabulary: got {tp}, which does not divide the {', '.join(bad)} of "
            f"the model in {where}. Pick a tensor_parallel_size that divides "
            f"{heads} heads, {kv} KV heads (or is a multiple of them) and a vocabulary of "
            f"{vocab}."
        )


def _token_versions(spans: Any, count: int) -> list[int]:
    """One version per output token from vLLM's ``weight_versions`` spans (``[start, end)``
    of output-token indexes, each with the label the engine core held when it sampled them)."""
    versions: list[int] = []
    for span in spans or []:
        if span.start != len(versions) or span.end < span.start:
            raise EngineError(f"vLLM returned weight-version spans with a gap: {spans!r}")
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != count or not versions:
        raise EngineError(
            f"vLLM's weight-version spans must cover every token: got {len(versions)} "
            f"versions for {count} tokens"
        )
    return versions


class VLLMEngine(GenerationEngine):
    """Samples with vLLM from the causal LM saved in ``model_dir``.

    ``like`` maps every HF parameter name of the model to a tensor of its shape:
    weight updates are checked against it (the sender's names are HF names, as in
    the policy's ``state_dict``). ``extra`` adds to ``vllm.LLM``'s arguments. ``options.chunk`` is how many engine steps (one
    token of every running request each) run between two calls of a ``between`` hook
    (see "In-flight weight updates").
    """

    inflight_updates = True

    def __init__(
        self,
        model_dir: str | Path,
        eos_id: int,
        like: Mapping[str, torch.Tensor],
        options: EngineSection,
        *,
        seed: int = 0,
        version: int = -1,
        device: str = "cpu",
        max_model_len: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ):
        if not options.recompute_kv_on_update:
            raise EngineError(
                "rl.engine.recompute_kv_on_update = false is for the hf engine only: vLLM "
                "recomputes the running requests' KV cache after every in-flight update. "
                'Remove the setting, or use rl.engine.kind = "hf".'
            )
        tp = options.tensor_parallel_size
        check_model_dir(model_dir, device, tp)
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            "dtype": options.dtype,
            "max_model_len": options.max_model_len or max_model_len,
            "tensor_parallel_size": options.tensor_parallel_size,
            "enforce_eager": options.enforce_eager,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            # T > 1: vLLM's worker processes; the engine core stays in this process.
            "distributed_executor_backend": "uni" if tp == 1 else "mp",
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
            # A weight update between two steps must not race a batch still in flight.
            "async_scheduling": False,
        }
        kwargs.update(extra or {})  # a subclass's own options (LoRA: vllm_lora.py)
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(options.cpu_kv_cache_gib * (1 << 30))
        else:
            kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            raise EngineError(
                f"vLLM failed to start on {model_dir}: {one_line(e)}. vLLM's own log is in "
                f"this replica's log, above this line."
            ) from e
        self.eos_id = int(eos_id)
        self.like = {k: (tuple(t.shape), t.dtype) for k, t in like.items()}
        self.updater = WeightUpdater(self.llm, like, tp, options.rollback_copy)
        # Without a rollback copy a stream cut off part-way would leave mixed weights:
        # the replica then fetches each version whole before the reload.
        self.streamed_updates = self.updater.held is not None
        self.tensor_parallel_size = tp
        self.seed = int(seed)
        self.version = version
        self.chunk = options.chunk
        self._calls = 0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        keys: Sequence[int] | None = None,
        between: Callable[[], None] | None = None,
    ) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_args(prompts, n, max_new_tokens, temperature, keys)
        if keys is None:  # the engine's own stream: a key per call and prompt
            self._calls += 1
            keys = [
                sample_seed(self.seed, self._calls * 1_000_003 + i) for i in range(len(prompts))
            ]
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=sample_seed(int(keys[i]), j),
                stop_token_ids=[self.eos_id],
                detokenize=False,
            )
            for i in range(len(prompts))
            for j in range(n)
        ]
        outs = self._run([TokensPrompt(prompt_token_ids=r) for r in rows], params, between)
        result = []
        for k, (row, out) in enumerate(zip(rows, outs, strict=True)):
            c = out.outputs[0]
            toks = list(c.token_ids)
            lps = []
            for t, step in zip(toks, c.logprobs or [], strict=True):
                if step is None or t not in step:
                    raise EngineError("vLLM returned no log-prob for a sampled token")
                lps.append(float(step[t].logprob))
            finished = bool(toks) and toks[-1] == self.eos_id
            versions = _token_versions(c.weight_versions, len(toks))
            result.append(
                Completion(
                    prompt_index=k // n,
                    prompt_ids=row,
                    token_ids=toks,
                    logprobs=lps,
                    finished=finished,
                    version=versions[0],
                    # Only a completion that spans an update lists its tokens' versions.
                    versions=versions if versions[0] != versions[-1] else [],
                )
            )
        return result

    def _run(
        self, prompts: list[Any], params: list[Any], between: Callable[[], None] | None
    ) -> list[Any]:
        """``LLM.generate``'s loop, with ``between`` called every ``chunk`` steps while
        requests remain. The requests' outputs, in the order of ``prompts``. Whatever
        ends the loop early (the hook raised, a reload failed) aborts the requests
        still in the engine, so that the next ``generate`` starts from an empty one."""
        engine = self.llm.llm_engine
        engine.set_weight_version(str(self.version))
        ids = self.llm.enqueue(prompts, params, self.adapter_request(), use_tqdm=False)
        done: dict[str, Any] = {}
        steps = 0
        try:
            while engine.has_unfinished_requests():
                done.update((o.request_id, o) for o in engine.step() if o.finished)
                steps += 1
                if between is None or steps % self.chunk or not engine.has_unfinished_requests():
                    continue
                call_between(self, between)
                engine.set_weight_version(str(self.version))
        except BaseException:
            engine.abort_request(ids, internal=True)
            raise
        # As LLM.generate: outputs carry the request's external id, a counter.
        return [done[k] for k in sorted(done, key=int)]

    def adapter_request(self) -> Any:
        """The ``LoRARequest`` a generation's requests are served with; None: the model's
        own weights (an engine serving a LoRA adapter: vllm_lora.py)."""
        return None

    def layout(self) -> Mapping[str, torch.Tensor]:
        return {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in self.like.items()}

    def load_weights(self, weights: Weights, version: int) -> None:
        """See :meth:`GenerationEngine.load_weights`: every worker takes the update, or
        none does. A stream of pairs is consumed as it arrives, each pair reloaded while
        the next one comes (``vllm_update.py``). A failure part-way (a bad pair, the
        channel broke, a worker failed) reloads every worker from the held copy of the
        previous version, which the engine then still holds; only when that is not
        possible is it left at version -1, which gets no prompts until a sync succeeds."""
        like = self.layout()
        if isinstance(weights, Mapping):
            check_names(like, weights.items())  # every name and shape, before any copy
            missing = sorted(set(like) - set(weights))
            if missing:
                raise ValueError(
                    f"weights must be a full state dict when given as a mapping: got "
                    f"{len(weights)} tensors, missing {missing[:5]}. Send every tensor, or "
                    f"stream a partial update as (name, tensor) pairs."
                )
        held = self.version
        self.version = -1  # until the reload is whole: a failure leaves no usable version
        try:
            self.updater.apply(weights.items() if isinstance(weights, Mapping) else weights)
        except UpdateFailed as e:
            if e.restored:
                self.version = held
            # A bad pair in the stream is the caller's error, as it is for a mapping.
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            now = (
                f"it is back at version {held}"
                if e.restored
                else "it holds no usable version until a sync succeeds"
            )
            log.error("reloading weights %d into vLLM failed (%s): %s", version, e, now)
            raise EngineError(f"reloading weights {version} into vLLM failed: {e}; {now}") from e
        # Also preempts the running requests of a generation this update lands in
        # (a ``between`` hook): their keys and values are recomputed under the new
        # weights at the next step, none is computed from the old ones again.
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.version = int(version)

    def digests(self) -> list[float]:
        """A digest of each worker's parameters, its tensor-parallel shard, in rank order."""
        return [float(d) for d in self.llm.collective_rpc("phalanx_digest")]

    def digest(self) -> float:
        """A digest of vLLM's parameters (equal weights, equal digests)."""
        return sum(self.digests())

    def close(self) -> None:
        """Free the engine (its workers, KV cache and staging buffers)."""
        updater = self.__dict__.pop("updater", None)
        if updater is not None:
            updater.close()
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # its worker processes, when T > 1
            del llm
