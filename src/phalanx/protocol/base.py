"""What every message of the controller's wire protocol shares: the strict base
model, the bounded field types, the reply envelope and the error body.

Every request and reply of ``/v1`` is one of the pydantic models of this
package, imported by both sides: the controller validates requests and builds
replies with them, and :mod:`phalanx.client` builds requests and parses
replies with them. Nothing crosses the wire as an untyped ``dict``; the
OpenAPI spec (``GET /openapi.json``) is generated from these models.

The rules every model follows:

- **strict**: a JSON ``true`` is not an integer, ``1`` is not a boolean and
  ``"5"`` is not a number (pydantic's strict mode);
- **closed**: unknown fields are refused (``extra="forbid"``), so a typo never
  falls back silently to a default;
- **bounded**: every integer has a minimum and a maximum, every string and
  list a maximum length, every float is finite. A value the controller
  accepted can always be journaled, served back and exported as a metric.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

API_VERSION = "v1"
MAX_WAIT_S = 30.0
"""Longest a long-poll (heartbeat, quorum, lease, commands) is held."""
MAX_INT = 2**62
"""Largest integer any field takes (steps, counters, byte counts): far beyond any
real job, and still exact as a float64 for Prometheus and as a JSON number."""
MAX_PAYLOAD_DEPTH = 32
"""Deepest nesting of a free-form JSON value (command payloads)."""


class Wire(BaseModel):
    """Base of every request and reply: strict, closed, finite."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


# -- bounded field types ------------------------------------------------------

Count = Annotated[int, Field(ge=0, le=MAX_INT)]
"""A count, a step, a sequence number, a byte size."""
Seq = Annotated[int, Field(ge=1, le=MAX_INT)]
"""A sequence number that starts at 1 (command ids, sync orders)."""
Version = Annotated[int, Field(ge=-1, le=MAX_INT)]
"""A weights version: the policy's committed step count; -1 for no weights yet."""
Seconds = Annotated[float, Field(ge=0, le=86400 * 365)]
WaitS = Annotated[float, Field(ge=0, le=MAX_WAIT_S)]
"""How long the controller may hold a long-poll before it answers."""
Wall = Annotated[float, Field(ge=0, le=1e11)]
"""A wall-clock time (``time.time()``)."""
ReplicaId = Annotated[str, Field(min_length=1, max_length=160)]
"""``name:incarnation``, as the register reply gave it."""
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
RoleName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")]
Address = Annotated[str, Field(max_length=256)]
"""``host:port`` of a replica's rendezvous store ('' when it serves none)."""
Text = Annotated[str, Field(max_length=1000)]
"""Free text: a reason, an error message."""
Url = Annotated[str, Field(min_length=1, max_length=4096)]
JobId = Annotated[str, Field(min_length=1, max_length=64)]
Key = Annotated[str, Field(min_length=1, max_length=64)]
Scalar = (
    Annotated[str, Field(max_length=1000)]
    | Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
    | float
    | bool
    | None
)
"""A capability's value: a bounded string or integer, a finite float, a flag."""


class Reply(Wire):
    """Every reply carries the controller's epoch (it changes when the controller
    restarts) and the job id."""

    epoch: Count
    job_id: JobId


class OkReply(Reply):
    ok: bool = True


class FieldError(Wire):
    field: Annotated[str, Field(max_length=200)]
    message: Annotated[str, Field(max_length=4000)]


class ErrorBody(Wire):
    """Every 4xx reply: what was wrong, and the field(s) at fault."""

    error: Annotated[str, Field(max_length=4000)]
    fields: Annotated[list[FieldError], Field(max_length=1000)] = []
    leader: Annotated[str, Field(max_length=2000)] = ""
    """On 421 (a standby controller was asked): the URL of the leader, '' while none
    is known (an election is under way)."""


class Health(Wire):
    ok: bool
    epoch: Count
    """The leader's controller epoch (0 from a standby)."""
    role: Literal["leader", "standby"] = "leader"
    """``standby``: a controller of an etcd journal that follows the leader."""
    leader: Annotated[str, Field(max_length=2000)] = ""
    """A standby's: the leader's URL ('' during an election)."""


# -- free-form JSON -----------------------------------------------------------


def check_plain_json(value: Any) -> Any:
    """Refuse free-form values that the replies could not serialize: non-finite
    numbers, strings with lone surrogates, and nesting past
    :data:`MAX_PAYLOAD_DEPTH`. Iterative, so a deep payload cannot exhaust the
    stack. Returns ``value`` unchanged (a pydantic validator)."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise ValueError(f"must nest at most {MAX_PAYLOAD_DEPTH} levels deep")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must hold finite numbers only: got {v}")
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must hold valid Unicode text (no lone surrogates)") from None
        elif isinstance(v, dict):
            todo.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, list):
            try:
                # A list of numbers (token ids, log-probs) is checked in one pass in
                # C: walking a rollout's thousand floats one by one was a tenth of
                # the controller's time per put. Anything else is walked below.
                if depth < MAX_PAYLOAD_DEPTH and all(map(math.isfinite, v)):
                    continue
            except (TypeError, OverflowError):
                pass
            todo.extend((x, depth + 1) for x in v)
    return value
