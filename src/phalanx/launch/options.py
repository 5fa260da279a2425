"""Command-line options of the local launcher and of ``phalanx scale``, parsed into
plain values with errors shaped "<thing> must <constraint>: got X". No heavy
imports: ``phalanx scale`` and ``phalanx run --help`` use this module."""

from __future__ import annotations

from phalanx.config import ROLE_NAMES, JobConfig
from phalanx.launch.chaos.spec import Chaos

__all__ = ["Chaos", "launch_counts", "parse_role_counts", "parse_scale"]


def _role_count(item: str, what: str, roles: tuple[str, ...] | list[str]) -> tuple[str, int]:
    role, sep, value = item.partition("=")
    role, value = role.strip(), value.strip()
    if not sep or not role:
        raise ValueError(f"{what} entries must look like ROLE=N: got {item!r}.")
    if role not in roles:
        raise ValueError(f"{what} role must be one of {list(roles)}: got {role!r}.")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"{what} count must be a whole number: got {role}={value!r}. Write e.g. {role}=2."
        ) from None
    if n < 0:
        raise ValueError(f"{what} count must be >= 0: got {role}={n}.")
    return role, n


def parse_role_counts(
    items: list[str], what: str, roles: tuple[str, ...] | list[str]
) -> dict[str, int]:
    """``["policy=1", "rollout=3"]`` -> ``{"policy": 1, "rollout": 3}``; each role once."""
    out: dict[str, int] = {}
    for item in items:
        role, n = _role_count(item, what, roles)
        if role in out:
            raise ValueError(f"{what} must name each role once: got {role} twice.")
        out[role] = n
    if not out:
        raise ValueError(f"{what} must name at least one ROLE=N: got none.")
    return out


def parse_scale(items: list[str]) -> dict[str, int]:
    """Arguments of ``phalanx scale ROLE=N [ROLE=N ...]`` (comma-separated also works)."""
    flat = [part for item in items for part in item.split(",") if part.strip()]
    return parse_role_counts(flat, "phalanx scale", ROLE_NAMES)


def launch_counts(cfg: JobConfig, text: str | None) -> tuple[dict[str, int], list[str]]:
    """Replicas to start per role for ``phalanx run``, and the config overrides the
    counts need.

    ``text`` is ``--replicas``: ``N`` (policy replicas, FT-DDP jobs only) or
    ``ROLE=N[,ROLE=N]``; roles left out start ``roles.<role>.n_init_replicas``.
    A count below ``n_init_replicas`` lowers it (else the role's first quorum
    would wait for replicas that never come), and returns that as an override
    for the controller and replicas; a count below ``min_replicas`` is refused.
    """
    counts = {role: rc.n_init_replicas for role, rc in cfg.roles.items()}
    if text is not None:
        text = text.strip()
        if text.lstrip("-").isdigit():
            if cfg.rl is not None:
                raise ValueError(
                    f"--replicas must be ROLE=N[,ROLE=N] for an RL job: got {text!r}. "
                    f"Write e.g. --replicas policy=1,rollout=3."
                )
            text = f"policy={text}"
        counts.update(parse_role_counts(text.split(","), "--replicas", list(cfg.roles)))
    overrides: list[str] = []
    for role, n in counts.items():
        rc = cfg.roles[role]
        if n < rc.min_replicas:
            raise ValueError(
                f"--replicas {role} must be >= roles.{role}.min_replicas: got {n}, expected "
                f">= {rc.min_replicas}. Start more, or lower --roles.{role}.min_replicas."
            )
        if n < rc.n_init_replicas:
            overrides.append(f"--roles.{role}.n_init_replicas={n}")
    return counts, overrides
