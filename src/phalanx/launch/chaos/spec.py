"""``--chaos``: the faults a launcher delivers to its own job, parsed from one value.

Grammar: comma-separated ``KEY=VALUE`` items, each key once; at least one fault
kind, each with its options (an option without its kind is refused)::

    kill-every=S              SIGKILL a replica (any role); it restarts after restart-after=S (2)
    stop-every=S              SIGSTOP a replica for a drawn time in [stop-for/2, stop-for]
                              (stop-for=S, default 5), then SIGCONT
    controller-kill-every=S   SIGKILL a controller process; the launcher restarts it on its
                              state dir and port
    engine-kill-every=S       SIGKILL a rollout replica's engine: its worker processes where
                              it has them (vLLM, tensor_parallel_size > 1), else the replica
                              (its engine runs in-process); restart-after applies
    partition-every=S         cut a replica off every other process for a drawn time in
                              [partition-for/2, partition-for] (partition-for=S, default 5):
                              its packets dropped by an nftables rule matching the group id
                              it runs as (root, nftables, --launcher local)
    slow=TARGET[:F]           throttle one replica for the whole job: SIGSTOP for F (0.5) of
                              every slow-cycle=S (1), SIGCONT for the rest; TARGET is a
                              replica (policy-1) or a role (one of its replicas, drawn)
    all-every=S               one fault every S, its kind drawn among every kind this job
                              and launcher can take (kill, stop, controller-kill,
                              engine-kill with rollout replicas, partition as root with
                              nftables, slow: a drawn replica
                              throttled for a drawn time in [slow-for/2, slow-for],
                              slow-for=S, default 10); alone, with the kinds' options
    seed=N                    the draws' seed (0)

Each ``*-every`` is a mean: the time to a kind's next fault is drawn uniformly in
[S/2, 3S/2] after its previous one (:mod:`phalanx.launch.chaos.schedule`).
``all-every=S`` is the soak's: faults of every kind, one at a time on average
every S, so that a long run meets each kind many times and their mixes.
``kill-every=S[,restart-after=S][,seed=N]`` means what it always has. Errors are
one line shaped "--chaos <thing> must ...: got X". No heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass

EVERY = {
    "kill-every": ("kill", "kill_every_s"),
    "stop-every": ("stop", "stop_every_s"),
    "controller-kill-every": ("controller-kill", "controller_kill_every_s"),
    "engine-kill-every": ("engine-kill", "engine_kill_every_s"),
    "partition-every": ("partition", "partition_every_s"),
}
"""``--chaos`` key of each periodic kind -> the kind's name (in logs and
``chaos.jsonl``) and its :class:`Chaos` field."""
KINDS = (*(kind for kind, _ in EVERY.values()), "slow")
ALL = "all-every"
"""The ``--chaos`` key whose faults draw their kind (:data:`ALL_KIND` in the schedule)."""
ALL_KIND = "all"
OPTIONS = {
    "restart-after": ("kill-every", "engine-kill-every", ALL),
    "stop-for": ("stop-every", ALL),
    "partition-for": ("partition-every", ALL),
    "slow-cycle": ("slow", ALL),
    "slow-for": (ALL,),
    "seed": (),
}
"""Each option -> the kinds it goes with (any of them; none: goes with every kind)."""
FORM = (
    "KIND=VALUE[,...] with KIND in kill-every, stop-every, controller-kill-every, "
    "engine-kill-every, partition-every, all-every (seconds) or "
    "slow=REPLICA_OR_ROLE[:FRACTION], and options restart-after, stop-for, partition-for, "
    "slow-cycle, slow-for, seed"
)


@dataclass
class Chaos:
    """The faults of one ``--chaos`` value; a kind left out is None."""

    kill_every_s: float | None = None
    restart_after_s: float = 2.0
    seed: int = 0
    stop_every_s: float | None = None
    stop_for_s: float = 5.0
    controller_kill_every_s: float | None = None
    engine_kill_every_s: float | None = None
    partition_every_s: float | None = None
    partition_for_s: float = 5.0
    slow: str | None = None
    """A replica name (``policy-1``) or a role (``rollout``: one of its replicas, drawn)."""
    slow_fraction: float = 0.5
    """Of every slow cycle, the share the slowed replica spends stopped."""
    slow_cycle_s: float = 1.0
    all_every_s: float | None = None
    """``all-every``: the mean time between faults whose kind is drawn."""
    slow_for_s: float = 10.0
    """``all-every``: a drawn slow lasts a time drawn in [slow-for/2, slow-for]."""

    def periods(self) -> dict[str, float]:
        """Each periodic kind asked for -> its mean period in seconds (``all``: the
        faults whose kind is drawn)."""
        every = {kind: getattr(self, field) for kind, field in EVERY.values()}
        every[ALL_KIND] = self.all_every_s
        return {k: v for k, v in every.items() if v is not None}

    def kinds(self) -> list[str]:
        """The kinds asked for, in :data:`KINDS` order (``all``: every kind the job can
        take, drawn)."""
        return [*self.periods(), *(["slow"] if self.slow else [])]

    @staticmethod
    def parse(text: str) -> Chaos:
        """One ``--chaos`` value (the grammar is in this module's docstring)."""
        opts: dict[str, str] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            k, sep, v = part.partition("=")
            k, v = k.strip(), v.strip()
            if not sep or not k or not v:
                raise ValueError(f"--chaos entries must look like key=value: got {part!r}.")
            if k not in EVERY and k not in OPTIONS and k not in ("slow", ALL):
                raise ValueError(
                    f"--chaos has no kind or option {k!r}: got {text!r}; write {FORM}."
                )
            if k in opts:
                raise ValueError(f"--chaos must give {k} once: got it twice in {text!r}.")
            opts[k] = v
        kinds = [k for k in opts if k in EVERY or k in ("slow", ALL)]
        if not kinds:
            raise ValueError(
                f"--chaos must name at least one fault kind: got {text!r}; write {FORM}."
            )
        if ALL in opts and len(kinds) > 1:
            others = ", ".join(k for k in kinds if k != ALL)
            raise ValueError(
                f"--chaos {ALL} draws from every kind itself, so it goes alone: got it with "
                f"{others}. Drop {others}, or drop {ALL}."
            )
        for opt, owners in OPTIONS.items():
            if opt in opts and owners and not any(o in opts for o in owners):
                raise ValueError(
                    f"--chaos {opt} goes with {' or '.join(owners)}: got {text!r}. Add the "
                    f"kind, or drop {opt}."
                )
        c = Chaos(seed=_int(opts, "seed", 0))
        for key, (_, field) in EVERY.items():
            if key in opts:
                setattr(c, field, _secs(opts, key, 0.0))
        c.restart_after_s = _secs(opts, "restart-after", 2.0, allow_zero=True)
        c.stop_for_s = _secs(opts, "stop-for", 5.0)
        c.partition_for_s = _secs(opts, "partition-for", 5.0)
        c.slow_cycle_s = _secs(opts, "slow-cycle", 1.0)
        if ALL in opts:
            c.all_every_s = _secs(opts, ALL, 0.0)
        c.slow_for_s = _secs(opts, "slow-for", 10.0)
        if "slow" in opts:
            c.slow, c.slow_fraction = _slow(opts["slow"])
        return c


def _secs(opts: dict[str, str], key: str, default: float, allow_zero: bool = False) -> float:
    if key not in opts:
        return default
    try:
        v = float(opts[key])
    except ValueError:
        v = float("nan")
    if not (v >= 0 if allow_zero else v > 0) or v == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"--chaos {key} must be a number of seconds {bound}: got {key}={opts[key]!r}."
        )
    return v


def _int(opts: dict[str, str], key: str, default: int) -> int:
    try:
        return int(opts.get(key, default))
    except ValueError:
        raise ValueError(
            f"--chaos {key} must be a whole number: got {key}={opts[key]!r}."
        ) from None


def _slow(value: str) -> tuple[str, float]:
    target, sep, frac = value.partition(":")
    target = target.strip()
    if not target:
        raise ValueError(f"--chaos slow must name a replica or a role: got slow={value!r}.")
    if not sep:
        return target, 0.5
    try:
        f = float(frac)
    except ValueError:
        f = float("nan")
    if not 0 < f < 1:
        raise ValueError(
            f"--chaos slow's fraction (the share of each cycle stopped) must be in (0, 1): "
            f"got slow={value!r}. Write e.g. slow=policy-1:0.5."
        )
    return target, f
