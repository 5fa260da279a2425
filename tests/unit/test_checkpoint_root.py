"""The checkpoint root's marker: replicas that first use a root at the same moment
agree on its identity, and a damaged marker is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.checkpoint.root import MARKER, RootError, identify

RACER = """
import os, sys, time
from phalanx.checkpoint.root import identify
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.001)
print(identify(sys.argv[1], resume=False).root_id, flush=True)
"""


def test_replicas_that_make_a_root_at_once_all_read_one_whole_marker(tmp_path: Path) -> None:
    root, go = tmp_path / "state", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(root), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in outs]
    ids = {out.strip() for out, _ in outs}
    assert len(ids) == 1 and len(ids.pop()) == 32
    # Nothing private is left beside the marker.
    assert sorted(os.listdir(root)) == [MARKER]


def test_a_damaged_marker_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text('{"root_')
    with pytest.raises(RootError) as e:
        identify(str(tmp_path))
    assert "\n" not in str(e.value) and "damaged (delete it to start afresh)" in str(e.value)


def test_a_root_keeps_its_identity_across_uses(tmp_path: Path) -> None:
    first = identify(str(tmp_path), resume=False).root_id
    assert identify(str(tmp_path), resume=False).root_id == first
