"""Where a training replica's tensors live, and what carries its collectives.

``train.device``: ``auto`` (CUDA when this process sees a GPU, else the CPU),
``cpu`` or ``cuda``. One GPU per rank: a rank takes ``cuda:LOCAL_RANK`` (the
ranks launcher and the agent set it, as torchrun does); a replica of one rank
takes ``cuda:0`` unless ``LOCAL_RANK`` says otherwise.

``train.data_plane``: the backend of the cross-replica collectives. On a GPU
it is NCCL by default; ``gloo`` keeps gloo with the tensors on the GPU, which
the torchft authors advise for replicas whose NCCL communicator could hang on
a dead peer, and which is the only way to run two replicas on one GPU (NCCL
refuses two ranks of one communicator on one device). On the CPU it is gloo.

NCCL's own watchdog (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) must give up before
the quorum does, or a hung communicator outlives the round that would have
replaced it: :func:`nccl_env` sets it below ``timeouts.quorum_s`` unless the
environment already says.
"""

from __future__ import annotations

import os

import torch

from phalanx.jobs.base import JobError

NCCL_HEARTBEAT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"


def resolve_device(want: str, local_rank: int | None = None) -> torch.device:
    """The device of ``train.device`` (``auto``, ``cpu`` or ``cuda``) for this rank.
    Raises JobError in one line when CUDA is asked for and absent, or when this rank's
    ``LOCAL_RANK`` has no GPU of its own."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    cuda = torch.cuda.is_available()
    if want == "cpu" or (want == "auto" and not cuda):
        return torch.device("cpu")
    if not cuda:
        raise JobError(
            "train.device = 'cuda' needs a CUDA GPU: this machine has none (torch "
            f"{torch.__version__} sees no device). Set train.device = 'auto' or 'cpu'."
        )
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise JobError(
            f"train.device = 'cuda' needs a GPU per rank: rank {local_rank} of this host has "
            f"none (it has {n}). Start at most {n} ranks per host, or set train.data_plane = "
            "'gloo' with train.device = 'cpu'."
        )
    return torch.device("cuda", local_rank)


def data_plane(device: torch.device, want: str) -> str:
    """The collectives' backend: ``nccl`` or ``gloo`` (``train.data_plane``: ``auto`` is
    NCCL on a GPU, gloo on the CPU). NCCL on the CPU is a JobError."""
    if want == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if want == "nccl" and device.type != "cuda":
        raise JobError(
            "train.data_plane = 'nccl' needs the replica's tensors on a GPU: got train.device "
            f"= {device.type!r}. Set train.data_plane = 'auto' or 'gloo'."
        )
    return want


def nccl_env(quorum_s: float) -> None:
    """Set NCCL's watchdog below the quorum timeout (unless the environment sets it):
    a communicator hung on a dead peer is torn down before the next quorum needs the
    device."""
    if NCCL_HEARTBEAT not in os.environ:
        os.environ[NCCL_HEARTBEAT] = str(max(1, int(quorum_s * 0.5)))
