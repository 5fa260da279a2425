"""Decoupled DiLoCo exchange through an object store: replicas that have no
network path to each other (serverless executors) average pseudo-gradients
through storage, once per outer round.

Round r, fragment f lives under ``ROOT/round_<r>/f<f>/``:

1. each replica writes ``<replica>.st`` (safetensors of its wire-compressed
   pseudo-gradient, with the CRC32 of every tensor in the metadata), in one
   atomic put (a local file is written to a temporary name and renamed);
2. the round's members are decided once, by whoever first creates
   ``_members.json`` (an exclusive create: ``O_EXCL`` on a local disk,
   ``If-None-Match: *`` on S3). With a controller, the proposal is its quorum;
   without one it is the objects present once ``min_replicas`` have arrived
   and a grace window has passed. Only objects named after the job's slots
   count, and the proposer reads each one it proposes and checks its checksum
   first: a stray or corrupt file can neither be listed as a member nor make up
   the ``min_replicas`` count;
3. every replica averages the decided set in the same order (sorted by
   replica id), in fp32 (fp64 for fp64 tensors), so all of them compute
   bit-identical outer steps. A corrupt or partial object fails its checksum
   and is left out (and counted) by every reader alike;
4. a replica that missed the deadline is not in the set; it still loads the
   round's objects and applies the same result, so it catches up;
5. in aggregator mode one replica (or a ``phalanx syncer``, which takes no
   part) writes ``_result.st`` and the others read one object instead of k
   (no k² reads); if it never comes, they average themselves, with the same
   result;
6. rounds older than ``keep_rounds`` are deleted.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable, Collection
from typing import Any

import fsspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from phalanx.checkpoint.dcp_io import tensor_bytes
from phalanx.checkpoint.store import is_local, put_atomic
from phalanx.comm.compress import Compression, decode, encode, wire_bytes
from phalanx.tensorfile import save as st_save

log = logging.getLogger("phalanx.diloco")

MEMBERS = "_members.json"
RESULT = "_result.st"


class RoundTimeout(TimeoutError):
    """An outer round could not be decided or read in time."""


class ObjectStoreAllReduce:
    """A DiLoCo :class:`~phalanx.train.diloco.Reducer` through fsspec storage.

    Who calls: every replica of the job, ``average`` once per (round,
    fragment), in order. ``replica_id`` must be unique and stable within the
    round. Failure: raises RoundTimeout when no decision or result appears
    within ``timeout_s``; the caller may retry the round."""

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        compression: Compression = "none",
        min_replicas: int = 1,
        grace_s: float = 1.0,
        timeout_s: float = 120.0,
        members: Callable[[int], list[str] | None] | None = None,
        aggregator: str | None = None,
        keep_rounds: int = 2,
        storage_options: dict[str, Any] | None = None,
        poll_s: float = 0.02,
        slots: Collection[str] | None = None,
    ):
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1: got {min_replicas}.")
        if "/" in replica_id or not replica_id:
            raise ValueError(
                f"replica_id must be a non-empty name without '/': got {replica_id!r}."
            )
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local = is_local(self.fs)
        self.replica_id = replica_id
        self.compression = compression
        self.min_replicas, self.grace_s, self.timeout_s = min_replicas, grace_s, timeout_s
        self.members_fn, self.aggregator = members, aggregator
        self.keep_rounds, self.poll_s = keep_rounds, poll_s
        self.bytes_sent = 0
        self.bytes_read = 0
        self.corrupt = 0
        self.left_out = 0
        self.averaged = 0
        """Rounds this replica averaged itself (in aggregator mode: the aggregator's)."""
        self.last_members: list[str] = []
        self.slots = frozenset(slots) if slots is not None else None
        """The names that may be members (the job's slots); None: any name."""
        self._checked: dict[str, bool] = {}
        """Objects read and checked by :meth:`_valid` (write-once, so checked once)."""

    # -- paths and objects -------------------------------------------------

    def key(self, round: int, fragment: int) -> str:
        return f"{self.root}/round_{round:08d}/f{fragment}"

    def _put(self, path: str, data: bytes) -> None:
        put_atomic(self.fs, path, data)

    @staticmethod
    def pack(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
        crcs = {k: zlib.crc32(tensor_bytes(v)) for k, v in tensors.items()}
        return st_save(tensors, metadata={**meta, "crc32": json.dumps(crcs)})

    def unpack(self, raw: bytes, what: str) -> dict[str, torch.Tensor] | None:
        """The tensors of an object, or None (counted) if it is corrupt or partial."""
        try:
            tensors = st_load(raw)
            header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
            crcs = json.loads(header["__metadata__"]["crc32"])
            bad = [k for k, v in tensors.items() if zlib.crc32(tensor_bytes(v)) != crcs.get(k)]
            if bad or set(crcs) != set(tensors):
                raise ValueError(f"checksum mismatch in {bad or 'the tensor list'}")
            return tensors
        except (SafetensorError, ValueError, KeyError, TypeError) as e:
            self.corrupt += 1
            log.warning("%s is corrupt or partial (%s): left out of the round", what, e)
            return None

    # -- the round ---------------------------------------------------------

    def average(
        self, tensors: list[torch.Tensor], *, round: int, fragment: int
    ) -> tuple[list[torch.Tensor], int]:
        key = self.key(round, fragment)
        wire: dict[str, torch.Tensor] = {}
        for i, t in enumerate(tensors):
            for part, v in encode(t.detach().cpu(), self.compression).items():
                wire[f"{i}.{part}"] = v
        self.fs.makedirs(key, exist_ok=True)
        mine = f"{key}/{self.replica_id}.st"
        # Objects are write-once: a replica restarted within a round it already
        # wrote keeps its first object, which readers may have averaged already.
        if not self.fs.exists(mine):
            self._put(mine, self.pack(wire, {"replica": self.replica_id}))
            self.bytes_sent += wire_bytes(wire)
        members = self._decide(key, round)
        self.last_members = members
        if self.replica_id not in members:
            self.left_out += 1
            log.warning(
                "round %d fragment %d: missed the deadline, left out; catching up from %d replicas",
                round,
                fragment,
                len(members),
            )
        if self.aggregator and self.aggregator != self.replica_id:
            got = self._read_result(key, tensors)
            if got is not None:
                self._gc(round)
                return got
        avg, n = self._average(key, members, tensors)
        if self.aggregator == self.replica_id:
            res = {str(i): a.contiguous() for i, a in enumerate(avg)}
            self._put(f"{key}/{RESULT}", self.pack(res, {"n": str(n)}))
        self._gc(round)
        return avg, n

    def result(
        self, like: list[torch.Tensor], *, round: int, fragment: int
    ) -> list[torch.Tensor] | None:
        """A decided round's average, for a replica catching up without taking
        part: the same bits the members computed. None when the round is not
        decided yet, or no longer complete in storage (garbage-collected)."""
        key = self.key(round, fragment)
        members = self._read_members(f"{key}/{MEMBERS}")
        if members is None:
            return None
        if self.aggregator:
            try:
                raw = self.fs.cat_file(f"{key}/{RESULT}")
            except FileNotFoundError:
                raw = None
            res = self.unpack(raw, f"{key}/{RESULT}") if raw is not None else None
            if res is not None:
                self.bytes_read += len(raw or b"")
                return [res[str(i)] for i in range(len(like))]
        if not set(members) <= set(self._present(key)):
            return None
        return self._average(key, members, like)[0]

    def aggregate(self, like: list[torch.Tensor], *, round: int, fragment: int) -> int:
        """Aggregator that is not a member (``phalanx syncer``): wait for the
        round's decision, average the members' objects and write the result.
        Returns how many were averaged. Raises RoundTimeout if the round is
        not decided within ``timeout_s``."""
        key = self.key(round, fragment)
        deadline = time.monotonic() + self.timeout_s
        while (members := self._read_members(f"{key}/{MEMBERS}")) is None:
            if time.monotonic() >= deadline:
                raise RoundTimeout(
                    f"outer round {round} fragment {fragment}: not decided under {key} within "
                    f"{self.timeout_s:.0f} s; are the replicas running?"
                )
            time.sleep(self.poll_s)
        avg, n = self._average(key, members, like)
        res = {str(i): a.contiguous() for i, a in enumerate(avg)}
        self._put(f"{key}/{RESULT}", self.pack(res, {"n": str(n)}))
        return n

    def _present(self, key: str) -> list[str]:
        # Never from fsspec's listings cache: a listing that raced another
        # writer's put (s3fs caches per instance, shared by threads) would
        # hide that object until the deadline.
        self.fs.invalidate_cache(key)
        try:
            names = self.fs.ls(key, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".st") and not base.startswith("_") and ".tmp-" not in base:
                name = base[: -len(".st")]
                if self.slots is None or name in self.slots:
                    out.append(name)
        return sorted(out)

    def _valid(self, key: str, rid: str) -> bool:
        """Whether ``rid``'s object under ``key`` passes its checksum (read once)."""
        path = f"{key}/{rid}.st"
        if path not in self._checked:
            if len(self._checked) > 4096:
                self._checked.clear()
            raw = self._cat(path)
            self._checked[path] = raw is not None and self.unpack(raw, path) is not None
        return self._checked[path]

    def _decide(self, key: str, round: int) -> list[str]:
        """The round's member list: read it if decided, else propose it."""
        deadline = time.monotonic() + self.timeout_s
        path = f"{key}/{MEMBERS}"
        quorum: list[str] | None = None
        asked = False
        enough_at: float | None = None
        while True:
            decided = self._read_members(path)
            if decided is not None:
                return decided
            if self.members_fn and not asked:
                # Asked once the round is known to be undecided: a late replica
                # reads the decision instead of waiting for a quorum.
                quorum, asked = self.members_fn(round), True
            present = self._present(key)
            if quorum is not None:
                ready = set(quorum) <= set(present)
                proposal = sorted(set(quorum) & set(present))
            else:
                if enough_at is None and len(present) >= self.min_replicas:
                    enough_at = time.monotonic()
                ready = enough_at is not None and time.monotonic() - enough_at >= self.grace_s
                proposal = present
            late = time.monotonic() >= deadline
            if ready or (late and proposal):
                proposal = [r for r in proposal if self._valid(key, r)]
                if quorum is None and len(proposal) < self.min_replicas and not late:
                    ready = False  # a corrupt object made up the count: wait for more
            if (ready or late) and proposal:
                try:
                    with self.fs.open(path, "xb") as f:
                        f.write(json.dumps({"members": proposal, "by": self.replica_id}).encode())
                    return proposal
                except (FileExistsError, OSError):
                    pass  # someone else decided first: read theirs
            if time.monotonic() >= deadline + self.timeout_s:
                raise RoundTimeout(
                    f"outer round {round}: no member list under {key} after "
                    f"{2 * self.timeout_s:.0f} s (present: {present}). Check that the replicas "
                    f"share the storage root."
                )
            time.sleep(self.poll_s)

    def _read_members(self, path: str) -> list[str] | None:
        try:
            raw = self.fs.cat_file(path)
            return sorted(json.loads(raw)["members"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError):
            return None  # being written (a local exclusive create is visible before its data)

    def _average(
        self, key: str, members: list[str], like: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int]:
        acc: list[Any] = [0] * len(like)
        n = 0
        for rid in members:
            raw = self._cat(f"{key}/{rid}.st")
            wire = self.unpack(raw, f"{key}/{rid}.st") if raw is not None else None
            if wire is None:
                continue
            try:
                parts = [
                    decode(
                        {
                            p.split(".", 1)[1]: v
                            for p, v in wire.items()
                            if p.split(".", 1)[0] == str(i)
                        },
                        self.compression,
                        t,
                    )
                    for i, t in enumerate(like)
                ]
            except (KeyError, RuntimeError) as e:
                self.corrupt += 1
                log.warning("%s/%s.st does not fit this model (%s): left out", key, rid, e)
                continue
            acc = [a + p for a, p in zip(acc, parts, strict=True)]
            n += 1
        if n == 0:
            raise RoundTimeout(f"outer round under {key}: no valid pseudo-gradient among {members}")
        self.averaged += 1
        return [(a / n).to(t.dtype) for a, t in zip(acc, like, strict=True)], n

    def _cat(self, path: str) -> bytes | None:
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            self.corrupt += 1
            log.warning("%s is missing: left out of the round", path)
            return None
        self.bytes_read += len(raw)
        return raw

    def _read_result(
        self, key: str, like: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int] | None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                raw = self.fs.cat_file(f"{key}/{RESULT}")
            except FileNotFoundError:
                time.sleep(self.poll_s)
                continue
            self.bytes_read += len(raw)
            res = self.unpack(raw, f"{key}/{RESULT}")
            if res is None:
                return None
            header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
            return [res[str(i)] for i in range(len(like))], int(header["__metadata__"]["n"])
        log.warning("%s: no aggregated result in %.0f s; averaging here", key, self.timeout_s)
        return None

    def _gc(self, round: int) -> None:
        old = round - self.keep_rounds
        if old < 0:
            return
        try:
            self.fs.rm(f"{self.root}/round_{old:08d}", recursive=True)
        except (FileNotFoundError, OSError):
            pass  # another replica deleted it first
