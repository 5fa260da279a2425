"""The controller's payload log (controller/payloads.py): payloads by key, kept in
memory and in append-only segments, read back whole at a restart, with the
journal deciding what is kept."""

from __future__ import annotations

from pathlib import Path

from phalanx.controller.payloads import HEADER, PayloadLog, frame, unframe


def payload(i: int, n: int = 8) -> dict:
    return {"rollout_id": f"p{i}.0", "logprobs": [-0.5] * n, "token_ids": list(range(n))}


def test_put_get_drop_and_reload(tmp_path: Path):
    log = PayloadLog(tmp_path)
    assert log.load() == 0
    log.put([(f"rl/p{i}.0", payload(i)) for i in range(5)])
    log.drop(["rl/p1.0", "rl/p9.0"])  # an unknown key is no error
    assert log.get("rl/p0.0") == payload(0) and log.get("rl/p1.0") is None
    log.close()
    again = PayloadLog(tmp_path)
    # A drop is not written: the journal says what is still needed.
    assert again.load() == 5
    assert again.retain({"rl/p0.0", "rl/p2.0"}) == 3
    assert sorted(again.items) == ["rl/p0.0", "rl/p2.0"]
    assert again.get("rl/p2.0") == payload(2)
    again.put([("rl/p7.0", payload(7))])  # into a fresh segment, never an old one
    assert len(list(tmp_path.glob("seg-*.log"))) == 2
    again.close()


def test_segments_rotate_and_go_once_all_their_payloads_are_dropped(tmp_path: Path):
    one = len(frame("rl/p0.0", payload(0)))
    log = PayloadLog(tmp_path, segment_bytes=3 * one)
    log.load()
    for i in range(9):
        log.put([(f"rl/p{i}.0", payload(i))])
    assert len(list(tmp_path.glob("seg-*.log"))) == 3
    log.drop([f"rl/p{i}.0" for i in range(3)])  # every payload of the first segment
    assert len(list(tmp_path.glob("seg-*.log"))) == 2
    log.drop(["rl/p3.0", "rl/p4.0"])  # not all of the second: it stays
    assert len(list(tmp_path.glob("seg-*.log"))) == 2
    assert log.stats()["held"] == 4
    log.close()


def test_a_torn_or_damaged_record_is_skipped_and_counted(tmp_path: Path):
    log = PayloadLog(tmp_path)
    log.load()
    log.put([(f"rl/p{i}.0", payload(i)) for i in range(3)])
    log.close()
    (seg,) = tmp_path.glob("seg-*.log")
    blob = bytearray(seg.read_bytes())
    second = len(frame("rl/p0.0", payload(0)))
    blob[second + HEADER.size + 5] ^= 0xFF  # a flipped bit in the second record
    seg.write_bytes(bytes(blob[:-3]))  # and a torn last write
    again = PayloadLog(tmp_path)
    assert again.load() == 1
    assert again.get("rl/p0.0") == payload(0)
    assert again.stats()["corrupt"] == 2
    good, bad = unframe(bytes(blob[:second]))
    assert good == [("rl/p0.0", payload(0))] and bad == 0


def test_a_segment_with_nothing_readable_is_set_aside(tmp_path: Path):
    (tmp_path / "seg-00000001.log").write_bytes(b"not a payload log at all")
    log = PayloadLog(tmp_path)
    assert log.load() == 0
    assert not (tmp_path / "seg-00000001.log").exists()
    assert (tmp_path / "seg-00000001.damaged").exists()
