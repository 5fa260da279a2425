"""Typed job config: one TOML file per job, with dotted CLI overrides.

A job file looks like::

    [job]
    id = "demo"

    [timeouts]
    collective_s = 5.0
    heartbeat_s = 10.0
    quorum_s = 60.0

    [roles.policy]
    min_replicas = 1
    n_init_replicas = 2

Unknown keys are refused (a typo must not silently fall back to a default),
and the timeout ordering ``collective < heartbeat < quorum`` is checked here,
at load, so that a bad combination never reaches a running job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from phalanx.config.file import ConfigError, apply_overrides, explain, read_toml
from phalanx.config.journal import check_journal
from phalanx.config.model import ModelSection
from phalanx.config.rl import RLConfig
from phalanx.config.rl_diloco import check_rl_diloco
from phalanx.config.stragglers import StragglersSection
from phalanx.config.track import TrackSection, merge_rl_track
from phalanx.config.train import DiLoCoSection, TrainSection
from phalanx.config.urls import check_storage_url

ROLE_NAMES = ("policy", "rollout")


class _Section(BaseModel):
    # Strings are strict (``id = 5`` is refused); a CLI override such as ``--job.id 42``
    # stays text because apply_overrides reads the field's type.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class JobSection(_Section):
    id: str = Field("job", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Job identifier, carried in every reply and log line."""
    seed: int = Field(0, ge=0)
    """Seed for everything random in the job (data order, init, sampling)."""


class TimeoutsSection(_Section):
    """All timeouts of the job, in seconds, in one place.

    The ordering ``collective_s < heartbeat_s < quorum_s`` is enforced: a
    hung collective must be aborted (and its peer reported) before the
    controller would evict that peer by heartbeat, and a quorum wait must
    outlive one heartbeat eviction so that survivors re-form instead of
    giving up.
    """

    collective_s: float = Field(5.0, gt=0, le=3600)
    """Longest a collective (all-reduce, heal transfer) may block before it is aborted."""
    collective_patience_s: float = Field(30.0, ge=0, le=86400)
    """Longest a collective may run past ``collective_s`` while every peer of its
    group still answers liveness pings as a member (a slow network: packet loss,
    not a dead, hung or cut-off peer, which stops answering). 0: give every
    collective up at ``collective_s``. Single-process replicas on gloo only."""
    heartbeat_s: float = Field(10.0, gt=0, le=3600)
    """A replica not heard from for this long is evicted."""
    quorum_s: float = Field(60.0, gt=0, le=86400)
    """Longest a replica waits for a quorum before giving up the step."""
    heartbeat_interval_s: float = Field(1.0, gt=0, le=600)
    """How often a replica heartbeats (each heartbeat is held open this long)."""
    suspect_grace_s: float = Field(0.25, gt=0, le=60)
    """A replica reported by a peer is evicted unless it heartbeats within this grace."""
    suspect_on_disconnect: bool = True
    """Suspect a replica whose held heartbeat (or quorum) connection drops, as if a
    peer had reported it: a SIGKILLed process is then evicted after the grace,
    with no collective in flight and no heartbeat timeout to wait for."""
    probe_address: bool = True
    """Connect to a suspect's advertised address (its rendezvous store): a refusal
    means its process is gone, and it is evicted at once instead of after the
    grace. Off: only the grace decides (tests that time one detector alone)."""
    lost_step_wait_s: float | None = Field(None, ge=0, le=86400)
    """How long a quorum whose newest step is behind the job's committed step waits
    for a replica that holds the job's step (a restarting one whose checkpoint root
    can load it included) before the job rolls back, explicitly, to the newest step
    it still has. None: ``quorum_s``. The job's step never goes back sooner."""

    @property
    def lost_step_wait(self) -> float:
        """:attr:`lost_step_wait_s`, its default resolved."""
        return self.quorum_s if self.lost_step_wait_s is None else self.lost_step_wait_s

    @model_validator(mode="after")
    def _ordered(self) -> TimeoutsSection:
        if not self.collective_s < self.heartbeat_s:
            raise ValueError(
                f"timeouts.collective_s must be < timeouts.heartbeat_s: got "
                f"collective_s={self.collective_s}, heartbeat_s={self.heartbeat_s}. "
                f"Raise heartbeat_s above {self.collective_s} or lower collective_s."
            )
        if not self.heartbeat_s < self.quorum_s:
            raise ValueError(
                f"timeouts.heartbeat_s must be < timeouts.quorum_s: got "
                f"heartbeat_s={self.heartbeat_s}, quorum_s={self.quorum_s}. "
                f"Raise quorum_s above {self.heartbeat_s} or lower heartbeat_s."
            )
        if not self.heartbeat_interval_s < self.heartbeat_s:
            raise ValueError(
                f"timeouts.heartbeat_interval_s must be < timeouts.heartbeat_s: got "
                f"{self.heartbeat_interval_s} >= {self.heartbeat_s}. A replica must "
                f"heartbeat several times per timeout; lower heartbeat_interval_s."
            )
        if not self.suspect_grace_s < self.heartbeat_s:
            raise ValueError(
                f"timeouts.suspect_grace_s must be < timeouts.heartbeat_s: got "
                f"{self.suspect_grace_s} >= {self.heartbeat_s}. The grace after a failure "
                f"report is meant to be short; lower suspect_grace_s."
            )
        return self


class RoleSection(_Section):
    """Membership and quorum rules of one role."""

    min_replicas: int = Field(1, ge=1, le=100_000)
    """No quorum (and so no step) with fewer participants than this. For an RL job's
    ``rollout`` role: no prompt is leased while fewer rollout replicas are members (they
    wait, taking any weight sync ordered, until enough have registered again)."""
    n_init_replicas: int = Field(1, ge=1, le=100_000)
    """The role's first quorum waits until this many replicas ask for it."""
    join_timeout_s: float = Field(1.0, ge=0, le=3600)
    """When some live replicas have not asked for the quorum yet, wait this long for them
    (from when enough have asked for a quorum, and the first of the last quorum has).
    One of the last quorum that still heartbeats is in its step, and is waited for up
    to ``max(collective_s, collective_patience_s)`` more (docs/architecture.md)."""

    @model_validator(mode="after")
    def _init_covers_min(self) -> RoleSection:
        if self.n_init_replicas < self.min_replicas:
            raise ValueError(
                f"n_init_replicas must be >= min_replicas: got n_init_replicas="
                f"{self.n_init_replicas}, min_replicas={self.min_replicas}. "
                f"Raise n_init_replicas to at least {self.min_replicas}."
            )
        return self


class ControllerSection(_Section):
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Requests with a larger body are refused with 413."""
    body_timeout_s: float = Field(10.0, gt=0, le=600)
    """A request whose body has not fully arrived this long after its headers is
    answered 408 and its connection closed (a stalled or trickled body holds no
    memory or connection for long)."""
    max_connections: int = Field(8192, ge=16, le=1_000_000)
    """Concurrent connections (and requests) the controller serves; more get 503. Each
    replica holds up to four (heartbeat, lifeline, quorum or lease, commands)."""
    journal: str = "sqlite"
    """Where every transition is journaled before it is acknowledged: ``sqlite`` (the
    embedded default, ``journal.sqlite`` in the state dir) or an existing etcd cluster,
    ``etcd://host:port[,host:port...][/prefix]`` (prefix default ``/phalanx/<job.id>``;
    docs/operations.md, "An etcd journal")."""
    etcd_ca_file: str | None = None
    """An ``etcds://`` journal: the CA file that signed etcd's certificates (default:
    the trust store of ``requests``: certifi's, or ``$REQUESTS_CA_BUNDLE``)."""
    etcd_cert_file: str | None = None
    """An ``etcds://`` journal: this controller's client certificate (PEM), for an etcd
    run with ``--client-cert-auth``; with ``etcd_key_file``."""
    etcd_key_file: str | None = None
    """The key of ``etcd_cert_file`` (PEM, unencrypted)."""
    journal_sync: Literal["normal", "full"] = "normal"
    """SQLite synchronous mode. `normal` survives a killed controller; `full` also a power loss."""
    tick_s: float = Field(0.02, gt=0, le=1)
    """How often the controller checks deadlines (evictions, join timeouts)."""
    history: int = Field(500, ge=10, le=100_000)
    """How many past events (evictions, quorums) the status API keeps."""
    stragglers: StragglersSection = Field(default_factory=StragglersSection)
    """``[controller.stragglers]``: slow replicas get a smaller share, or are evicted."""

    @field_validator("journal")
    @classmethod
    def _journal(cls, v: str) -> str:
        return check_journal(v)

    @model_validator(mode="after")
    def _etcd_tls(self) -> ControllerSection:
        files = {
            "etcd_ca_file": self.etcd_ca_file,
            "etcd_cert_file": self.etcd_cert_file,
            "etcd_key_file": self.etcd_key_file,
        }
        named = [k for k, v in files.items() if v]
        if named and not self.journal.startswith("etcds://"):
            raise ValueError(
                f"controller.{named[0]} applies to an etcd journal over TLS: got "
                f"controller.journal = {self.journal!r}. Write the journal as etcds://host:port "
                f"(or drop controller.{named[0]})."
            )
        if bool(self.etcd_cert_file) != bool(self.etcd_key_file):
            given, missing = (
                ("etcd_cert_file", "etcd_key_file")
                if self.etcd_cert_file
                else ("etcd_key_file", "etcd_cert_file")
            )
            raise ValueError(
                f"controller.{given} needs controller.{missing} too: a client certificate "
                f"and its key go together. Set both, or neither."
            )
        return self


class CheckpointSection(_Section):
    """Universal checkpoints of the policy (``phalanx.checkpoint``)."""

    url: str = ""
    """Storage root: a path, ``file://``, ``s3://``, ``gs://`` or ``memory://`` URL.
    Empty: no checkpoints."""
    every_steps: int = Field(0, ge=0, le=10_000_000)
    """Save after every N committed steps (and at the end of the job). 0: only at the end."""
    keep_last: int = Field(3, ge=1, le=10_000)
    """Committed checkpoints to keep; older ones are deleted after each commit."""
    async_save: bool = True
    """Copy the state to host memory and persist it in the background (the step
    stalls only for the copy). False: the step waits for the whole save."""
    resume: bool = True
    """On start, load the latest usable checkpoint (any layout), before joining."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for the URL (e.g. ``{"anon": true}``, an S3 endpoint)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return v and check_storage_url(v, "checkpoint.url")


class ReplicaSection(_Section):
    """The processes one replica spans."""

    ranks: int = Field(1, ge=1, le=1024)
    """Ranks per replica: the model is sharded over them with FSDP2 (HSDP: fault
    tolerance across replicas, sharding inside). Every replica of a job has the same.
    In an RL job it applies to the policy replicas; a rollout replica is one process
    (its engine's own parallelism is ``rl.engine``'s)."""
    tp: int = Field(1, ge=1, le=1024)
    """Tensor-parallel degree inside a replica (:mod:`phalanx.train.tp_hf`): its
    ranks form a (ranks / tp) x tp mesh, FSDP2 over the first dimension and the
    model's own TP plan (transformers') over the second. Needs a model that has a
    plan (``model.arch = "llama"``, or a Llama/Qwen/Mistral directory)."""

    @model_validator(mode="after")
    def _tp_divides(self) -> ReplicaSection:
        if self.ranks % self.tp:
            raise ValueError(
                f"replica.tp must divide replica.ranks: got tp={self.tp}, ranks={self.ranks}. "
                f"Pick tp among the divisors of {self.ranks} (FSDP runs over ranks / tp)."
            )
        return self

    @property
    def dp(self) -> int:
        """Data-parallel ranks inside a replica (FSDP's): the ranks of a TP group
        compute the same samples."""
        return self.ranks // self.tp


def _default_roles() -> dict[str, RoleSection]:
    return {"policy": RoleSection()}


class JobConfig(_Section):
    job: JobSection = Field(default_factory=JobSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    roles: dict[str, RoleSection] = Field(default_factory=_default_roles)
    """Roles of the job, by name: `policy` and/or `rollout`."""
    train: TrainSection = Field(default_factory=TrainSection)
    replica: ReplicaSection = Field(default_factory=ReplicaSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    rl: RLConfig | None = None
    """RL post-training (GRPO) with policy and rollout roles. None: an FT-DDP training job."""
    diloco: DiLoCoSection | None = None
    """DiLoCo outer loop for the training job. None: FT-DDP (an all-reduce every step)."""
    track: TrackSection = Field(default_factory=TrackSection)
    """Experiment tracking of the job, whatever its kind (``[rl.track]``, its old
    place for RL jobs, is folded in here)."""

    @model_validator(mode="before")
    @classmethod
    def _one_track(cls, data: Any) -> Any:
        return merge_rl_track(data)

    @model_validator(mode="after")
    def _known_roles(self) -> JobConfig:
        unknown = sorted(set(self.roles) - set(ROLE_NAMES))
        if unknown:
            raise ValueError(
                f"roles must be among {list(ROLE_NAMES)}: got {unknown}. "
                f"Rename the [roles.*] section(s)."
            )
        if not self.roles:
            raise ValueError("roles must name at least one role: add a [roles.policy] section.")
        if self.rl is not None and set(self.roles) != set(ROLE_NAMES):
            raise ValueError(
                f"roles must be exactly {list(ROLE_NAMES)} for an RL job (one with an [rl] "
                f"section): got {sorted(self.roles)}. Add [roles.policy] and [roles.rollout]."
            )
        if self.replica.ranks > 1 and self.diloco is not None:
            raise ValueError(
                f"replica.ranks must be 1 in a DiLoCo job: got {self.replica.ranks}. "
                "Replicas of several ranks run the FT data-parallel job and the RL policy "
                "only, for now; set [replica] ranks = 1."
            )
        self._check_tp()
        self._check_exact()
        if self.diloco is not None and self.rl is not None:
            check_rl_diloco(self.rl, self.diloco, self.roles["policy"])
        elif self.diloco is not None and self.train.steps % self.diloco.sync_every:
            raise ValueError(
                f"train.steps must be a multiple of diloco.sync_every in a DiLoCo job "
                f"(train.steps counts inner steps): got steps={self.train.steps}, "
                f"sync_every={self.diloco.sync_every}."
            )
        return self

    def _check_tp(self) -> None:
        """``[replica] tp`` applies to a Hugging Face model with a TP plan: the FT
        data-parallel job's (``[train.model]``) or the RL policy's (``[rl.model]``:
        llama, or a directory; :mod:`phalanx.train.tp_hf`). The model's own fit (plan,
        heads, vocabulary) is checked by ``phalanx run`` and by each rank, which read it."""
        tp = self.replica.tp
        if tp == 1:
            return
        if self.rl is not None:
            m = self.rl.model
            if m.path is None and m.arch == "gpt2":
                raise ValueError(
                    f"replica.tp must be 1 for a gpt2 policy built from config: got {tp}. "
                    "GPT-2 has no tensor-parallel plan in transformers; set rl.model.arch = "
                    '"llama", or [replica] tp = 1.'
                )
            if self.rl.lora is not None:
                raise ValueError(
                    f"replica.tp must be 1 with [rl.lora]: got {tp}. The adapter wraps the "
                    "projections the TP plan splits; train the adapter with FSDP alone "
                    "([replica] ranks) and tp = 1."
                )
            return
        if not isinstance(self.train.model, ModelSection):
            what = (
                f"train.script {self.train.script!r}"
                if self.train.script
                else (f"train.model = {self.train.model!r} (a built-in task)")
            )
            raise ValueError(
                f"replica.tp applies to your Hugging Face model ([train.model] path): got "
                f"{what}. Set [train.model] path = DIR, or [replica] tp = 1."
            )
        if self.train.lora is not None:
            raise ValueError(
                f"replica.tp must be 1 with [train.lora]: got {tp}. The adapter wraps the "
                "projections the TP plan splits; train the adapter with FSDP alone "
                "([replica] ranks) and tp = 1."
            )

    def _check_exact(self) -> None:
        """An exact reduction refuses what it cannot honour (module doc of
        :mod:`phalanx.train.exact`): a lossy wire format, a sum of more terms than
        its headroom holds."""
        if not self.train.exact_reduction:
            return
        # Only here: phalanx.train.exact imports torch, which a controller (every job's
        # config is checked in it) must not load: a second and a half at its start, and
        # half a million objects every full garbage collection walks.
        from phalanx.train.exact import MAX_TERMS

        dc = self.diloco
        if dc is not None and dc.compression != "none":
            raise ValueError(
                f"train.exact_reduction needs diloco.compression = 'none': got "
                f"{dc.compression!r}. A compressed exchange is not exact; set one of them."
            )
        if dc is not None and dc.mode != "sync":
            raise ValueError(
                "train.exact_reduction applies to diloco.mode = 'sync' only: got "
                f"{dc.mode!r}. Set train.exact_reduction = false for decoupled rounds."
            )
        terms = -(-self.train.global_batch_size // self.exact_unit)
        if dc is None and terms > MAX_TERMS:
            raise ValueError(
                f"train.global_batch_size / train.micro_batch_size must be at most {MAX_TERMS} "
                f"micro-batches with train.exact_reduction: got {terms}. Raise "
                f"train.micro_batch_size to at least "
                f"{-(-self.train.global_batch_size // MAX_TERMS)}."
            )

    @property
    def exact_micro_batch_size(self) -> int:
        """Samples per rank in one exact unit: ``train.micro_batch_size``, or the
        global batch cut in ``n_init_replicas x replica.ranks`` (the share of each
        rank of a calm run, which then holds one unit per replica)."""
        if self.train.micro_batch_size:
            return self.train.micro_batch_size
        n = self.roles["policy"].n_init_replicas if "policy" in self.roles else 1
        return max(1, -(-self.train.global_batch_size // (n * self.replica.dp)))

    @property
    def exact_unit(self) -> int:
        """Samples of the global batch in one exact unit (every data-parallel rank's
        micro-batch)."""
        return self.exact_micro_batch_size * self.replica.dp

    @property
    def job_steps(self) -> int:
        """The controller's steps until the job is done: optimizer steps, or
        outer rounds in a DiLoCo job."""
        if self.diloco is not None:
            return self.train.steps // self.diloco.sync_every
        return self.train.steps

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Load a job config from TOML (or defaults when ``path`` is None), then apply overrides."""
    data, source = read_toml(path, "job config")
    data = apply_overrides(data, list(overrides or []), JobConfig)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(e, "job config", source)) from e
