"""Equal states give equal safetensors files, byte for byte (issue 20: the metadata's
key order changed from one process to the next, so identical weights had different
checksums)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from phalanx.tensorfile import save

WRITE = """
import sys, torch
from pathlib import Path
from phalanx.tensorfile import save, save_file
t = {f"w{i}": torch.arange(6, dtype=torch.float32) * i for i in range(4)}
meta = {k: str(i) for i, k in enumerate(["step", "cursor", "format", "skeleton", "a", "zz"])}
save_file(t, Path(sys.argv[1]), metadata=meta)
sys.stdout.buffer.write(save(t, meta))
"""


def test_equal_states_are_equal_bytes_in_every_process(tmp_path: Path):
    digests = set()
    for i in range(3):  # each process hashes the metadata with its own random seed
        path = tmp_path / f"{i}.safetensors"
        out = subprocess.run(
            [sys.executable, "-c", WRITE, str(path)], capture_output=True, check=True
        ).stdout
        assert out == path.read_bytes()
        digests.add(hashlib.sha256(out).hexdigest())
    assert len(digests) == 1
    with safe_open(str(tmp_path / "0.safetensors"), "pt") as f:
        assert f.metadata() == {"step": "0", "cursor": "1", "format": "2", "skeleton": "3",
                                "a": "4", "zz": "5"}  # fmt: skip
        assert torch.equal(f.get_tensor("w3"), torch.arange(6, dtype=torch.float32) * 3)


def test_metadata_keys_are_sorted_and_the_header_keeps_its_length():
    t = {"x": torch.ones(3)}
    raw = save(t, {"b": "2", "a": "1", "é": "3"})
    n = int.from_bytes(raw[:8], "little")
    head = raw[8 : 8 + n].decode()
    assert head.index('"a"') < head.index('"b"') < head.index('"é"')
    assert n % 8 == 0 and len(raw) == 8 + n + 12
