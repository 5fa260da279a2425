"""TensorBoard event files, written with tensorboard's own event writer.

The launcher writes them; it has no use for torch, so this uses the writer that
torch's ``SummaryWriter`` wraps, without importing torch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from phalanx.track.base import Tracker


class TensorBoardTracker(Tracker):
    """Scalars to event files under ``logdir`` (``tensorboard --logdir <run>/tb``)."""

    def __init__(self, logdir: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self.writer = EventFileWriter(str(logdir), flush_secs=10)

    def log(self, step: int, metrics: Mapping[str, float], wall: float | None = None) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()
        ]
        self.writer.add_event(
            event_pb2.Event(
                wall_time=wall or time.time(), step=step, summary=summary_pb2.Summary(value=values)
            )
        )

    def close(self) -> None:
        self.writer.close()
