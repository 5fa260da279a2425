"""Rank 0 of ``test_streamed.py``'s group, as a process of its own (so that the test
can SIGKILL it mid-stream): it broadcasts :func:`weights` in buckets.

    python stream_sender.py STORE BUCKET [STALL_AFTER [SAFETENSORS]]

With ``STALL_AFTER`` (>= 0) it sends that many buckets, prints ``stalled`` and
waits on its stdin (the test kills it there); without (or -1), it sends them all
and exits 0. With ``SAFETENSORS`` it sends that file's tensors instead, as the
policy leader of a sync order would (the collective channel's header first, on
mesh 1's group, as version 21).
"""

from __future__ import annotations

import sys

import torch

from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.transport.collective import fingerprint, pack


def weights() -> dict[str, torch.Tensor]:
    """Tensors of three dtypes whose boundaries fall inside buckets (sorted by name:
    ``a.weight`` first, 16 KiB)."""
    g = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(64, 64, generator=g),
        "b.bias": torch.randn(1001, generator=g, dtype=torch.float64),
        "c.norm": torch.randn(3004, generator=g).to(torch.bfloat16),
        "d.ids": torch.randint(0, 1 << 40, (77,), generator=g),
    }


def main() -> int:
    store, bucket = sys.argv[1], int(sys.argv[2])
    stall = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    w = weights()
    comm = TorchCommunicator(30.0)
    if len(sys.argv) > 4:
        from safetensors.torch import load_file

        w = load_file(sys.argv[4])
        comm.configure(store, "weights/m1", 0, 2)
        header = [21, fingerprint(w), sum(t.numel() * t.element_size() for t in w.values()), bucket]
        comm.broadcast(torch.tensor(header, dtype=torch.int64), 0)
    else:
        comm.configure(store, "stream", 0, 2)
    flat = pack(w)
    for i, off in enumerate(range(0, flat.numel(), bucket)):
        if i == stall:
            print("stalled", flush=True)
            sys.stdin.read()  # until the test kills this process
        comm.broadcast(flat[off : off + bucket], 0)
    comm.abort()
    return 0


if __name__ == "__main__":
    sys.exit(main())
