"""What a training step costs: peak memory, the device's peak rate, and MFU.

Shared by the RL policy (:mod:`phalanx.rl.step`) and the training jobs
(:mod:`phalanx.jobs.hf_task`), so that both report the same figures the same
way: ``tokens_per_s``, ``mfu`` (model FLOPs utilisation: the 6·N FLOPs a token
costs a dense model of N parameters in a forward and a backward, over the
device's peak rate) and ``peak_mem_mb``.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: the CUDA caching allocator's peak
    on a GPU, else the peak resident set size (all of the process, not only tensors)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux and bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


PEAK_TFLOPS = {
    # Dense peak per GPU from NVIDIA's data sheets: (bf16 tensor core, fp32 non-tensor).
    "H200": (989.4, 66.9),
    "H100": (989.4, 66.9),
    "A100": (312.0, 19.5),
    "L40S": (362.1, 91.6),
}


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Peak TFLOP/s of ``device`` in ``precision``: ``override`` if given, else the
    data-sheet figure of a known GPU, else None (a CPU has no agreed peak)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, fp32) in PEAK_TFLOPS.items():
        if key in name:
            return bf16 if precision == "bf16" else fp32
    return None


def mfu(
    params: int, tokens: float, seconds: float, peak: float | None, devices: int = 1
) -> float | None:
    """Model FLOPs utilisation: 6 N FLOPs per token trained (forward 2N, backward 4N;
    Kaplan et al. 2020), over ``seconds`` on ``devices`` devices of ``peak`` TFLOP/s
    each. Recomputation under activation checkpointing is not counted: it is overhead,
    not model work. None without a peak (a CPU)."""
    if peak is None or seconds <= 0 or devices < 1:
        return None
    return 6.0 * params * tokens / seconds / (peak * 1e12 * devices)
