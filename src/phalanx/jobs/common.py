"""What the job loops share: the JSON lines they print for the launcher, the
setup of an FT replica of the built-in task (client, model, data, manager),
its checkpoints, and the step boundary after a commit (operator commands,
scheduled saves, drain).

Every job loop prints one JSON line per event on stdout (:func:`emit`):
``start``, ``step``, ``retry``, ``checkpoint``, ``sync``, ``rollout``,
``done``; ``phalanx run`` reads them for its progress view and summary.
"""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phalanx.client import ControllerClient, ControllerError, Rejected
from phalanx.config import JobConfig
from phalanx.jobs.base import JobError
from phalanx.train.manager import Manager
from phalanx.transport.base import store_name

if TYPE_CHECKING:
    from phalanx.checkpoint import Checkpointer

log = logging.getLogger("phalanx.train")


def flat_state(manager: Manager, optimizer: bool = True) -> dict[str, torch.Tensor]:
    """Model and (with ``optimizer``) optimizer tensors under stable names (for
    comparing replicas)."""
    out = {f"model.{k}": v.detach().clone() for k, v in manager.model.state_dict().items()}
    if not optimizer:
        return out
    for pid, st in manager.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{pid}.{k}"] = v.detach().clone().reshape(v.shape)
    return out


def save_final(path: Path, manager: Manager, optimizer: bool = True) -> None:
    """The final state as one safetensors file: the same bytes on every replica that
    holds the job's last step (each replica of one job writes its own)."""
    from phalanx.tensorfile import save_file

    cursor = manager.sampler.cursor if manager.sampler is not None else 0
    meta = {"step": str(manager.step), "cursor": str(cursor)}
    save_file(flat_state(manager, optimizer), path, metadata=meta)


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def job_store_name(job_id: str, client: ControllerClient) -> str:
    """The job's namespace in a rollout store: the job id and the ledger's run (from
    the controller), so that a rerun of a job never meets the previous run's payloads."""
    st = client.status()
    return store_name(job_id, st.rl.run if st.rl is not None else "")


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of handing it back to the OS.

    Every step, the optimizer's temporaries (two of the model's size for AdamW)
    are freed and allocated again; with glibc's defaults they are unmapped and
    faulted back in each time, which costs more than the all-reduce on a small
    CPU replica (docs/benchmarks.md). With these thresholds they stay in the
    heap. Returns False where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def register(client: ControllerClient) -> None:
    """Register ``client``; a replica whose layout the controller refuses (it spans
    another number of ranks than the role's live replicas), whose advertised address it
    cannot connect to, or whose checkpoint root is not its peers', cannot run:
    JobError, in the controller's one line."""
    refusals = ("ranks", "address", "state_root")
    try:
        client.register()
    except Rejected as e:
        if e.status in (409, 422) and any(f.field in refusals for f in e.body.fields):
            raise JobError(f"the controller refused this replica: {e.body.error}") from e
        raise


def use_root(
    client: ControllerClient,
    url: str | None,
    *,
    what: str,
    storage_options: dict[str, Any] | None = None,
    resume: bool = True,
) -> None:
    """Give ``client`` (before it registers) the checkpoint root ``url`` it saves to,
    named by ``what`` in errors, with the newest step it can resume from there
    (:mod:`phalanx.checkpoint.root`). None or '': no root. JobError in one line when
    the root cannot be written."""
    if not url:
        return
    from phalanx.checkpoint.root import RootError, identify

    try:
        root = identify(url, what=what, storage_options=storage_options, resume=resume)
    except RootError as e:
        raise JobError(str(e)) from None
    client.set_root(root.url, root.root_id, root.latest)


def make_checkpointer(cfg: JobConfig, client: ControllerClient) -> Checkpointer | None:
    """The job's checkpointer, or None when ``checkpoint.url`` is empty. Each
    commit is reported to the controller and printed as a ``checkpoint`` event."""
    cc = cfg.checkpoint
    if not cc.url:
        return None
    from phalanx.checkpoint import Checkpointer

    def committed(step: int, url: str, manifest: Any) -> None:
        try:
            client.checkpoint_committed(step, url, manifest.nbytes)
        except ControllerError as e:  # the checkpoint is committed all the same
            log.warning("could not tell the controller about checkpoint step %d: %s", step, e)
        emit(
            {
                "event": "checkpoint",
                "replica": client.replica_id,
                "step": step,
                "url": url,
                "nbytes": manifest.nbytes,
                "stall_s": round(ckpt.last_stall_s, 6),
                "save_s": round(ckpt.last_save_s, 4),
            }
        )

    ckpt = Checkpointer(
        cc.url,
        keep_last=cc.keep_last,
        storage_options=cc.storage_options,
        layout={"kind": "ft-ddp"},
        on_commit=committed,
    )
    return ckpt


def resume(ckpt: Checkpointer, manager: Manager) -> int | None:
    """Load the latest usable checkpoint into ``manager`` (model in place, then
    everything else). Returns its step, or None when there is none."""
    r = ckpt.load({"model": manager.model.state_dict()})
    if r is None:
        return None
    if "optimizer" not in r.state:
        # A model-only checkpoint (``phalanx ckpt import`` of an HF directory): the
        # model was filled in place by the load; optimizer, sampler and RNG start fresh
        # at step 0, the step an import is saved as.
        log.warning(
            "checkpoint step %d (%s) holds the model only: the optimizer starts fresh",
            r.step,
            r.url,
        )
        return r.step
    manager.load_checkpoint(r.state)
    log.info("resumed from checkpoint step %d (%s) in %.2f s", r.step, r.url, r.seconds)
    return r.step


def save_checkpoint(ckpt: Checkpointer, cfg: JobConfig, manager: Manager, *, final: bool) -> None:
    """Rank 0 of the quorum saves (all replicas hold the same state after a commit)."""
    if manager.rank != 0:
        return
    extra = {"config": cfg.model_dump(mode="json"), "job_id": cfg.job.id}
    # Every replica of the quorum holds the whole state: one process (rank 0) writes
    # it (with its ranks, when it spans several), and the layout says how many
    # replicas trained the step.
    ckpt.layout = manager.checkpoint_layout()
    if final or not cfg.checkpoint.async_save:
        ckpt.save(manager.step, manager.checkpoint_state(), extra)
    else:
        ckpt.save_async(manager.step, manager.checkpoint_state(), extra)


def state_hash(model: torch.nn.Module) -> str:
    """A digest (CRC32, hex) of this replica's parameters, in name order: replicas
    holding the same state print the same one."""
    import zlib

    crc = 0
    for _, p in sorted(model.state_dict().items()):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p  # (a collective if sharded)
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


def emit_step(
    replica_id: str | None,
    r: Any,
    cursor: int,
    samples: list[int] | None,
    dataset_size: int | None = None,
    **extra: Any,
) -> None:
    """The ``step`` line of a committed FT step ``r`` (a :class:`~phalanx.train.manager.StepResult`).
    With ``samples`` (``train.log_samples``), ``dataset_size`` goes with them: the
    sampler's, so that ``phalanx audit`` can rebuild each step's global batch from the
    seed alone (:mod:`phalanx.audit.data`)."""
    logged: dict[str, Any] = {"samples": samples} if samples is not None else {}
    if samples is not None and dataset_size is not None:
        logged["dataset_size"] = dataset_size
    emit(
        {
            "event": "step",
            "replica": replica_id,
            "step": r.step,
            "loss": r.loss,
            "participants": r.participants,
            "quorum_id": r.quorum_id,
            "healed": r.healed,
            "cursor": cursor,
            **extra,
            **logged,
            "t": time.time(),
        }
    )
