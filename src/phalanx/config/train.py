"""The training job's sections of a job file: ``[train]`` (the FT data-parallel
job's model, data and optimisation) and ``[diloco]`` (its low-communication outer
loop). :mod:`phalanx.config.job` assembles them with the job's other sections and
checks what spans sections (an exact reduction's, a DiLoCo job's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from phalanx.config.data import DataSection
from phalanx.config.model import LoraSection, ModelSection
from phalanx.config.urls import check_storage_url


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainSection(_Section):
    """The FT data-parallel training job: your model and data, or a built-in task."""

    model: Literal["mlp", "transformer"] | ModelSection = "mlp"
    """Your model: a ``[train.model]`` table naming a local Hugging Face causal-LM
    directory (``path``), the same model spec as ``[rl.model]``, trained on
    ``[train.data]``. Or a built-in task, for tests and the quick demo: ``mlp``, an
    MLP regressing a fixed random function (``in_dim``, ``hidden``, ``out_dim``), or
    ``transformer``, a small transformer learning counting sequences by next-token
    prediction (``vocab``, ``seq``, ``d_model``, ``n_heads``, ``n_layers``)."""
    lora: LoraSection | None = None
    """LoRA on your ``[train.model]``: only the adapter is trained, all-reduced, healed
    and checkpointed (docs/architecture.md, "LoRA"). None: the whole model is trained."""
    script: str = ""
    """Your own training loop instead: a Python file that builds its model, optimizer
    and data and drives :class:`phalanx.Replica` (``examples/own_loop.py``). ``phalanx
    replica`` runs it as ``python FILE`` would, so ``phalanx run``, the agent and Ray
    start it like any replica."""
    script_args: list[str] = Field(default_factory=list, max_length=256)
    """Its command-line arguments (``sys.argv[1:]``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the replica's tensors live: ``auto`` takes a GPU when the process sees one
    (``cuda:LOCAL_RANK``: one GPU per rank), else the CPU."""
    data_plane: Literal["auto", "nccl", "gloo"] = "auto"
    """The collectives' backend between replicas: ``auto`` is NCCL on a GPU and gloo on
    the CPU; ``gloo`` keeps gloo with the tensors on the GPU (a replica whose NCCL could
    hang on a dead peer, and the only way to run two replicas on one GPU)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Your model's compute dtype: ``bf16`` runs forward and backward under autocast
    while the weights, their gradients and the optimizer's moments stay fp32 (master
    weights)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (your model; HF's gradient
    checkpointing, non-reentrant): less memory for more compute."""
    peak_tflops: float | None = Field(None, gt=0, le=1e6)
    """The device's peak TFLOP/s, for MFU; None: a known GPU's data-sheet figure (a CPU
    has none, and reports no MFU)."""
    vocab: int = Field(64, ge=2, le=1 << 20)
    seq: int = Field(16, ge=2, le=1 << 16)
    d_model: int = Field(64, ge=1, le=1 << 16)
    n_heads: int = Field(4, ge=1, le=1024)
    n_layers: int = Field(2, ge=1, le=1024)

    steps: int = Field(100, ge=1, le=10_000_000)
    """Committed optimizer steps to run."""
    global_batch_size: int = Field(64, ge=1, le=1 << 24)
    """Samples per committed step, constant whatever the number of replicas."""
    micro_batch_size: int = Field(0, ge=0, le=1 << 24)
    """Largest forward/backward chunk; a replica's share is accumulated in such chunks. 0: whole share."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0, le=1)
    momentum: float = Field(0.0, ge=0, lt=1)
    """SGD momentum (sgd only)."""
    dtype: Literal["float32", "float64"] = "float32"
    """The weights' dtype (the master weights of your model too: ``float64`` for runs
    compared to 1e-9, as the tests do)."""
    threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads per replica process."""
    in_dim: int = Field(32, ge=1, le=1 << 16)
    hidden: list[int] = Field(default_factory=lambda: [128, 128])
    """Hidden layer widths of the MLP."""
    out_dim: int = Field(8, ge=1, le=1 << 16)
    dataset_size: int = Field(8192, ge=1, le=1 << 26)
    """Samples in the synthetic regression dataset (generated from job.seed)."""
    bucket_mb: float = Field(25.0, gt=0, le=4096)
    """All-reduce bucket size."""
    exact_reduction: bool = False
    """Sum gradients exactly (fixed point, int64; docs/architecture.md, "Bit-exact
    reduction"), so that the result is the same bits whoever took part in a step
    and whoever computed which micro-batch. The micro-batches are then fixed slices
    of the global batch, shared out whole (``micro_batch_size`` 0: the global batch
    cut in ``roles.policy.n_init_replicas x replica.ranks`` of them). In a DiLoCo
    job it applies to the outer all-reduce."""
    step_delay_s: float = Field(0.0, ge=0, le=60)
    """Extra time per step (a stand-in for a bigger model, for demos)."""
    slow_replica: str = Field("", max_length=128)
    """The replica (by name, e.g. ``policy-1``) that :attr:`slowdown` throttles; ''
    for none."""
    slowdown: float = Field(1.0, ge=1, le=100)
    """How many times as long ``slow_replica``'s share takes to compute: a throttled
    device in proportion to its work, for tests, demos and bench/ops_straggler.py
    (``2``: half speed). The controller's straggler handling
    (``[controller.stragglers]``) gives it a smaller share."""
    log_samples: bool = True
    """Print the sample indices each replica trained on with every committed step:
    ``phalanx audit --against`` compares the committed global batches with a calm
    run's from them (off: it compares the data cursors only). A step's line grows by
    the replica's share of the global batch."""
    log_state_hash: bool = False
    """Print a digest of the replica's parameters with every committed step (for audits:
    replicas that commit a step must hold the same state after it, partitions or not)."""
    data: DataSection | None = None
    """The training data for a Hugging Face model (``train.model`` a model spec):
    ``[train.data]``, read, tokenized and cached by :mod:`phalanx.data.text`. None:
    the built-in task's synthetic data."""

    def slowdown_for(self, name: str) -> float:
        """:attr:`slowdown` for the replica named ``name`` (1: not throttled)."""
        return self.slowdown if name and name == self.slow_replica else 1.0

    @model_validator(mode="after")
    def _heads_divide(self) -> TrainSection:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"train.d_model must divide by train.n_heads: got d_model={self.d_model}, "
                f"n_heads={self.n_heads}. Pick a d_model that is a multiple of n_heads."
            )
        return self

    @model_validator(mode="after")
    def _your_model(self) -> TrainSection:
        if isinstance(self.model, ModelSection) and self.model.path is None:
            raise ValueError(
                "train.model must name your model's directory: got a [train.model] table "
                "without path. Set [train.model] path = DIR (a local Hugging Face causal LM), "
                "or train.model = 'mlp' for the built-in task."
            )
        if isinstance(self.model, ModelSection) and self.data is None:
            raise ValueError(
                "train.model (your model) must come with its data: got no [train.data]. "
                "Add [train.data] path = FILE_OR_DIR (text, JSONL, Parquet, Arrow or a "
                "save_to_disk directory)."
            )
        if self.data is not None and not isinstance(self.model, ModelSection):
            raise ValueError(
                f"[train.data] is for your model: got train.model = {self.model!r} (a built-in "
                "task, whose data is synthetic). Add [train.model] path = DIR, or drop "
                "[train.data]."
            )
        if self.lora is not None and not isinstance(self.model, ModelSection):
            raise ValueError(
                f"[train.lora] is for your model: got train.model = {self.model!r}. Add "
                "[train.model] path = DIR (a local Hugging Face causal LM), or drop [train.lora]."
            )
        builtin = not isinstance(self.model, ModelSection) and not self.script
        if builtin and (self.precision != "fp32" or self.activation_checkpointing):
            raise ValueError(
                "train.precision and train.activation_checkpointing apply to your model: got "
                f"train.model = {self.model!r} (a built-in task). Set [train.model] path, or "
                "leave them at fp32 and false."
            )
        if self.script and isinstance(self.model, ModelSection):
            raise ValueError(
                f"train.script and [train.model] are two ways to say what trains: got both "
                f"(script {self.script!r}). Keep one."
            )
        return self


class DiLoCoSection(_Section):
    """DiLoCo / Streaming DiLoCo (``phalanx.train.diloco``). In a DiLoCo job,
    ``train.steps`` counts inner steps (a multiple of ``sync_every``), the
    inner optimizer is ``train.optimizer`` (the paper: AdamW, lr 4e-4, weight
    decay 0.1) and a step of the controller (and of ``checkpoint.every_steps``)
    is an outer round."""

    mode: Literal["sync", "objectstore"] = "sync"
    """``sync``: over the FT manager's process group, a quorum per round.
    ``objectstore``: decoupled replicas exchange through ``url`` (no network
    between replicas), launched by ``executor``."""
    sync_every: int = Field(50, ge=1, le=1_000_000)
    """H: inner steps per outer round."""
    outer_lr: float = Field(0.7, gt=0, le=10)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    fragments: int = Field(1, ge=1, le=10_000)
    """Streaming DiLoCo: parameter fragments synchronised in turn (must divide sync_every)."""
    tau: int = Field(0, ge=0)
    """Streaming DiLoCo overlap: inner steps between a fragment's exchange and its use."""
    alpha: float = Field(0.0, ge=0, le=1)
    """Streaming DiLoCo mixing of the local fragment with the new global one."""
    compression: Literal["none", "fp16", "bf16", "int8"] = "none"
    """Wire format of pseudo-gradients (always accumulated in fp32)."""
    url: str = ""
    """objectstore: the exchange root (``file://``, ``s3://``, ``gs://``, ``memory://``)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    replicas: int = Field(4, ge=1, le=10_000)
    """objectstore: replicas the launcher starts (named r0, r1, ...; each its own data shard)."""
    min_replicas: int = Field(1, ge=1, le=10_000)
    """objectstore without a controller: a round is decided once this many
    pseudo-gradients are in and ``grace_s`` has passed."""
    grace_s: float = Field(1.0, ge=0, le=3600)
    round_timeout_s: float = Field(120.0, gt=0, le=86400)
    """objectstore: decide with whoever is present after this long."""
    aggregator: str = Field("", pattern=r"^(|syncer|r\d+)$")
    """objectstore: who writes each round's average, so that the slots read one
    object instead of k: a slot (``r0``), or ``syncer`` (a ``phalanx syncer``
    process that takes no part; ``phalanx run`` starts it). Empty: every slot
    averages the k objects itself."""
    keep_rounds: int = Field(4, ge=1, le=1_000_000)
    """objectstore: rounds kept in storage (older ones are deleted)."""
    executor: Literal["local", "ray"] = "local"
    """objectstore: where ``phalanx run`` starts the replicas."""
    ray_address: str = ""
    """executor = ray: the cluster to join (empty: start a local Ray instance)."""
    ray_cpus_per_replica: float = Field(1.0, ge=0, le=1024)
    """executor = ray: Ray CPUs each slot's actor asks for."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """objectstore: restarts of a failed replica by ``phalanx run``."""

    @property
    def slot_names(self) -> list[str]:
        """objectstore: the replicas' names, ``r0`` .. ``r<replicas - 1>``."""
        return [f"r{i}" for i in range(self.replicas)]

    @model_validator(mode="after")
    def _streaming(self) -> DiLoCoSection:
        if self.sync_every % self.fragments:
            raise ValueError(
                f"diloco.sync_every must be divisible by diloco.fragments: got sync_every="
                f"{self.sync_every}, fragments={self.fragments}. Pick fragments among the "
                f"divisors of sync_every."
            )
        if self.tau >= self.sync_every // self.fragments:
            raise ValueError(
                f"diloco.tau must be < sync_every / fragments = "
                f"{self.sync_every // self.fragments}: got {self.tau}."
            )
        if self.url:
            check_storage_url(self.url, "diloco.url")
        if self.mode == "objectstore" and not self.url:
            raise ValueError(
                "diloco.url must name the exchange root for mode = objectstore: got none. "
                "Set it to a path or an fsspec URL (file://, s3://, gs://, memory://)."
            )
        if self.aggregator.startswith("r") and int(self.aggregator[1:]) >= self.replicas:
            raise ValueError(
                f"diloco.aggregator must be a slot r0 .. r{self.replicas - 1}, 'syncer' or empty: "
                f"got {self.aggregator!r}."
            )
        if self.min_replicas > self.replicas:
            raise ValueError(
                f"diloco.min_replicas must be <= diloco.replicas: got {self.min_replicas} > "
                f"{self.replicas}."
            )
        return self

    def outer(self) -> Any:
        """The :class:`~phalanx.train.diloco.DiLoCoConfig` of this section."""
        from phalanx.train.diloco import DiLoCoConfig

        return DiLoCoConfig(
            H=self.sync_every,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            nesterov=self.nesterov,
            fragments=self.fragments,
            tau=self.tau,
            alpha=self.alpha,
            compression=self.compression,
        )
