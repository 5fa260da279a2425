"""DiLoCo experiment: a byte-level language model trained by k replicas, DDP
next to DiLoCo at several H and with int8 exchange, at equal tokens.

    python bench/diloco.py [--json] [--quick] [--steps 400] [--k 4] [--plot PNG]

DiLoCo is Douillard et al., arXiv 2311.08105: each of k replicas runs H inner
AdamW steps on its own data shard, then all take one outer Nesterov-SGD step
(outer lr 0.7, momentum 0.9) on the averaged pseudo-gradient Δ = θ_global -
θ_local. The outer loop is :class:`phalanx.train.diloco.DiLoCo`, unchanged.

- **Corpus** (offline, deterministic): the ``.py`` files of this Python's
  standard library (``sysconfig.get_paths()["stdlib"]``, without
  ``site-packages``), sorted by relative path. File i goes to validation if
  i % 10 == 9, else to training; training file j goes to replica shard
  j % k (disjoint shards, each a mix of the whole library). Bytes are tokens
  (vocab 256).
- **Model**: a small causal transformer in plain torch (pre-norm blocks,
  learned positions, GELU MLP), float32.
- **Warm-up**: one replica trains ``--warmup-steps`` from scratch on the
  whole training split with batch k x ``--batch`` and the LR ramped linearly
  over the first third (run on the DDP code path below, which is the same
  math). Every arm starts from this checkpoint, model *and* AdamW state, as
  the paper starts DiLoCo from a pretrained checkpoint.
- **Arms**, each ``--steps`` steps of k x ``--batch`` windows (equal tokens;
  replica r reads the same seeded stream of random windows of its shard in
  every arm). k replicas run in threads, one torch thread each, each with its
  own model and AdamW:

  - ``ddp``: every step the replicas average their fp32 gradients, then clip
    and step alike: DDP, implemented as such (it equals one model on the
    k-times batch up to float rounding);
  - ``diloco``: ``DiLoCo(model, DiLoCoConfig(H=H, compression=...), reducer)``
    after each inner step.

  The in-process reducer waits for all k at a barrier, decodes every
  replica's wire form (``phalanx.comm.compress``: ``none``, or ``int8`` for
  the compressed arm), sums in rank order in fp32 and divides by k, so every
  replica gets the same bits (the replicas are checked identical at the end).
  Inner optimizer, the same for every arm: AdamW(``--lr``, betas (0.9, 0.95),
  weight decay 0.1), cosine decay from ``--lr`` to 0.1 x ``--lr`` over the
  arm's steps, gradient-norm clip 1.0.

Figures per arm:

- ``val_loss``: mean cross-entropy (nats per byte) of the final model on a
  fixed set of ``--val-windows`` validation windows, the same for all arms;
  ``val_loss_ratio_vs_ddp``: over DDP's.
- ``bytes_sent``: per replica, what it puts on the wire over the arm: DDP its
  fp32 gradient every step; DiLoCo the ``wire_bytes`` of its encoded
  pseudo-gradient each outer round. ``bytes_ratio_vs_ddp`` = DDP's / the
  arm's (exactly H for uncompressed exchange; asserted).
- ``wall_s`` / ``cpu_s``: the arm's training time and the process's CPU time
  over it (evaluations excluded). The machine may be shared: wall time is
  noisy, CPU time less so.
- ``curve``: validation loss every ``--eval-every`` steps (for DiLoCo only at
  outer-round ends, where the replicas hold θ_global), for ``--plot``.

Goals: DiLoCo at H = 50 within 1.03x of DDP's validation loss; int8 exchange
within 0.5 % of fp32 at H = 50.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from phalanx.comm.compress import Compression, decode, encode, wire_bytes  # noqa: E402
from phalanx.train.diloco import DiLoCo, DiLoCoConfig  # noqa: E402

GOAL_H50_VS_DDP = 1.03
GOAL_INT8_VS_FP32 = 0.005
VAL_EVERY_NTH_FILE = 10


@dataclass(frozen=True)
class Settings:
    """One run's sizes and hyper-parameters (the defaults fit ~10 min on 2 cores)."""

    k: int = 4
    steps: int = 400
    """Steps per arm (a multiple of every H, so each arm ends on an outer round)."""
    warmup_steps: int = 400
    batch: int = 32
    """Windows per replica per step."""
    ctx: int = 64
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 8e-3
    """Peak inner LR (AdamW), the same for the warm-up, DDP and DiLoCo."""
    lr_final_ratio: float = 0.1
    wd: float = 0.1
    clip: float = 1.0
    hs: tuple[int, ...] = (10, 50, 100)
    int8_h: int = 50
    eval_every: int = 50
    val_windows: int = 256
    threads: int = 2
    """torch threads for the single-replica warm-up and evaluation; replicas use 1 each."""
    seed: int = 0

    def __post_init__(self) -> None:
        for h in (*self.hs, self.int8_h, self.eval_every):
            if self.steps % h:
                raise ValueError(
                    f"--steps must be a multiple of every H and of --eval-every: got "
                    f"steps={self.steps}, {h}. Pick a multiple of 100."
                )


# -- corpus ----------------------------------------------------------------------------


@dataclass
class Corpus:
    shards: list[torch.Tensor]
    """Replica r's training bytes (uint8)."""
    train: torch.Tensor
    val: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)


def load_corpus(k: int) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    files = sorted(
        (
            p
            for p in root.rglob("*.py")
            if p.is_file() and not skip & set(p.relative_to(root).parts)
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    val, train = [], []
    for i, p in enumerate(files):
        (val if i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE - 1 else train).append(p.read_bytes())
    shards = [b"".join(train[r::k]) for r in range(k)]

    def as_tensor(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8)

    info = {
        "stdlib": str(root),
        "files": len(files),
        "train_bytes": sum(map(len, train)),
        "val_bytes": sum(map(len, val)),
    }
    return Corpus(
        [as_tensor(s) for s in shards], as_tensor(b"".join(train)), as_tensor(b"".join(val)), info
    )


class Stream:
    """A seeded stream of random windows (ctx + 1 bytes) of one byte tensor."""

    def __init__(self, data: torch.Tensor, ctx: int, batch: int, seed: int):
        self.data, self.ctx, self.batch = data, ctx, batch
        self.g = torch.Generator().manual_seed(seed)
        self.span = torch.arange(ctx + 1)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.data) - self.ctx - 1, (self.batch, 1), generator=self.g)
        return self.data[starts + self.span].long()


# -- model -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    """A causal transformer over bytes (vocab 256)."""

    def __init__(self, s: Settings):
        super().__init__()
        self.emb = nn.Embedding(256, s.d_model)
        self.pos = nn.Parameter(torch.randn(s.ctx, s.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(s.d_model, s.heads) for _ in range(s.layers))
        self.ln = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def loss_of(m: nn.Module, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(w[:, :-1]).reshape(-1, 256), w[:, 1:].reshape(-1))


@torch.no_grad()
def val_loss(m: nn.Module, windows: torch.Tensor, chunk: int = 64) -> float:
    m.eval()
    total = sum(
        loss_of(m, windows[i : i + chunk]).item() * len(windows[i : i + chunk])
        for i in range(0, len(windows), chunk)
    )
    m.train()
    return total / len(windows)


def make_opt(m: nn.Module, s: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.wd)


def cosine_lr(s: Settings, step: int) -> float:
    """The arms' inner LR at ``step`` (0-based): cosine from lr to lr_final_ratio x lr."""
    lo = s.lr * s.lr_final_ratio
    return lo + 0.5 * (s.lr - lo) * (1 + math.cos(math.pi * step / s.steps))


def inner_step(
    m: nn.Module, opt: torch.optim.Optimizer, w: torch.Tensor, lr: float, clip: float
) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss_of(m, w).backward()
    nn.utils.clip_grad_norm_(m.parameters(), clip)
    opt.step()


def snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in m.state_dict().items()}


# -- the in-process reducer -------------------------------------------------------------


class ThreadReducer:
    """k replicas in threads: ``average`` encodes the caller's Δ, waits for all k,
    decodes every replica's wire form and sums in rank order in fp32."""

    def __init__(self, k: int, how: Compression):
        self.k, self.how = k, how
        self.barrier = threading.Barrier(k)
        self.slots: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(k)]
        self.bytes_sent = [0] * k

    def for_rank(self, rank: int) -> Any:
        group = self

        class Rank:
            def average(self, tensors, *, round, fragment):
                wires = [encode(t, group.how) for t in tensors]
                group.bytes_sent[rank] += sum(wire_bytes(w) for w in wires)
                group.slots[rank] = wires
                group.barrier.wait()
                out = []
                for i, like in enumerate(tensors):
                    acc = decode(group.slots[0][i], group.how, like).clone()
                    for r in range(1, group.k):
                        acc += decode(group.slots[r][i], group.how, like)
                    out.append(acc / group.k)
                group.barrier.wait()  # nobody refills a slot before all have read
                return out, group.k

        return Rank()


# -- arms -------------------------------------------------------------------------------


@dataclass
class Arm:
    arm: str
    H: int
    compression: str
    val_loss: float = 0.0
    val_loss_ratio_vs_ddp: float = 0.0
    bytes_sent: int = 0
    bytes_ratio_vs_ddp: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    curve: list[tuple[int, float]] = field(default_factory=list)


def streams(data: list[torch.Tensor], s: Settings, seed: int) -> list[Stream]:
    """Replica r's seeded stream of windows of ``data[r]``."""
    return [Stream(d, s.ctx, s.batch, seed=s.seed * 1000 + seed + r) for r, d in enumerate(data)]


def warm_up(c: Corpus, s: Settings, val: torch.Tensor) -> tuple[dict, dict, float]:
    """One replica from scratch on the whole training split, batch k x ``batch``, LR
    ramped linearly over the first third: the arms' common start. It runs on the DDP
    code path (k threads averaging gradients: the same math as one model on the
    k-times batch), which keeps both cores busy without intra-op threads."""
    torch.manual_seed(s.seed)
    m = ByteLM(s)
    fresh = (snapshot(m), make_opt(m, s).state_dict(), float("nan"))
    ramp = max(1, s.warmup_steps // 3)
    data = streams([c.train] * s.k, s, seed=100)
    m, _, _, _ = train_ddp(
        s, fresh, data, s.warmup_steps, lambda step: s.lr * min(1.0, (step + 1) / ramp)
    )
    return snapshot(m), m.opt_state, val_loss(m, val)


def from_checkpoint(
    s: Settings, ckpt: tuple[dict, dict, float]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = ByteLM(s)
    m.load_state_dict(ckpt[0])
    opt = make_opt(m, s)
    # load_state_dict keeps the given tensors (no copy): without the deepcopy the
    # k replicas would share, and race on, one set of AdamW moments.
    opt.load_state_dict(copy.deepcopy(ckpt[1]))
    return m, opt


def run_replicas(
    s: Settings, ckpt, data: list[Stream], group: ThreadReducer, body: Callable[..., None]
) -> tuple[list[tuple[nn.Module, torch.optim.Optimizer]], float, float]:
    """k replicas in threads (1 torch thread each), all from the checkpoint:
    ``body(rank, model, opt, stream)``. Returns the replicas, wall and CPU seconds."""
    torch.set_num_threads(1)
    replicas = [from_checkpoint(s, ckpt) for _ in range(s.k)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            body(rank, *replicas[rank], data[rank])
        except BaseException as e:  # surfaced below, after the other threads are freed
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), name=f"replica-{r}") for r in range(s.k)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    torch.set_num_threads(s.threads)
    if errors:
        raise errors[0]
    first = snapshot(replicas[0][0])
    for m, _ in replicas[1:]:
        for n, t in m.state_dict().items():
            assert torch.equal(t, first[n]), f"replicas must end identical: {n} differs"
    assert len(set(group.bytes_sent)) == 1, group.bytes_sent
    return replicas, wall, cpu


def train_ddp(
    s: Settings, ckpt, data: list[Stream], steps: int, lr_at: Callable[[int], float]
) -> tuple[nn.Module, list[tuple[int, dict]], ThreadReducer, tuple[float, float]]:
    """k replicas, each with its own model and AdamW; every step they average their
    fp32 gradients (in rank order, the same bits on all), then clip and step alike.
    Returns replica 0 (with ``opt_state``), snapshots every ``eval_every`` steps, the
    reducer (bytes) and (wall, CPU) seconds."""
    group = ThreadReducer(s.k, "none")
    snaps: list[tuple[int, dict]] = []

    def body(rank: int, m: nn.Module, opt: torch.optim.Optimizer, data: Stream) -> None:
        params = list(m.parameters())
        reducer = group.for_rank(rank)
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss_of(m, data.next()).backward()
            avg, _ = reducer.average([p.grad for p in params], round=step, fragment=0)
            for p, a in zip(params, avg, strict=True):
                p.grad = a
            nn.utils.clip_grad_norm_(params, s.clip)
            opt.step()
            if rank == 0 and (step + 1) % s.eval_every == 0:
                snaps.append((step + 1, snapshot(m)))

    replicas, wall, cpu = run_replicas(s, ckpt, data, group, body)
    m, opt = replicas[0]
    m.opt_state = copy.deepcopy(opt.state_dict())
    return m, snaps, group, (wall, cpu)


def run_ddp(c: Corpus, s: Settings, ckpt, val: torch.Tensor) -> Arm:
    data = streams(c.shards, s, seed=1)
    m, snaps, group, (wall, cpu) = train_ddp(s, ckpt, data, s.steps, lambda t: cosine_lr(s, t))
    arm = Arm("ddp", 1, "none", bytes_sent=group.bytes_sent[0], wall_s=wall, cpu_s=cpu)
    return finish_arm(arm, s, ckpt, snaps, m, val)


def run_diloco(
    c: Corpus,
    s: Settings,
    ckpt,
    val: torch.Tensor,
    H: int,  # noqa: N803 (the paper's symbol)
    how: Compression,
) -> Arm:
    group = ThreadReducer(s.k, how)
    cfg = DiLoCoConfig(H=H, compression=how)
    snaps: list[tuple[int, dict]] = []

    def body(rank: int, m: nn.Module, opt: torch.optim.Optimizer, data: Stream) -> None:
        outer = DiLoCo(m, cfg, group.for_rank(rank))
        for step in range(s.steps):
            inner_step(m, opt, data.next(), cosine_lr(s, step), s.clip)
            outer.after_inner_step()
            # Right after an outer round every replica holds θ_global.
            if rank == 0 and (step + 1) % s.eval_every == 0 and (step + 1) % H == 0:
                snaps.append((step + 1, snapshot(m)))
        outer.finish()

    replicas, wall, cpu = run_replicas(s, ckpt, streams(c.shards, s, seed=1), group, body)
    arm = Arm("diloco", H, how, bytes_sent=group.bytes_sent[0], wall_s=wall, cpu_s=cpu)
    return finish_arm(arm, s, ckpt, snaps, replicas[0][0], val)


def finish_arm(arm: Arm, s: Settings, ckpt, snaps, m: nn.Module, val: torch.Tensor) -> Arm:
    arm.val_loss = val_loss(m, val)
    probe = ByteLM(s)
    arm.curve = [(0, ckpt[2])]
    for step, sd in snaps:
        probe.load_state_dict(sd)
        arm.curve.append((step, val_loss(probe, val)))
    return arm


# -- report -----------------------------------------------------------------------------


def host() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, load {load}, python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def run(s: Settings, log=print) -> dict[str, Any]:
    t_all = time.perf_counter()
    c = load_corpus(s.k)
    val = Stream(c.val, s.ctx, s.val_windows, seed=s.seed * 1000 + 777).next()
    log(
        f"corpus: {c.info['files']} files, {c.info['train_bytes']:,} train / "
        f"{c.info['val_bytes']:,} val bytes; {s.val_windows} val windows of {s.ctx}"
    )
    t0 = time.perf_counter()
    ckpt = warm_up(c, s, val)
    log(
        f"warm-up: {s.warmup_steps} steps, val_loss {ckpt[2]:.4f} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    arms = [run_ddp(c, s, ckpt, val)]
    log(f"ddp: val_loss {arms[0].val_loss:.4f} ({arms[0].wall_s:.0f} s)")
    for H, how in [*((h, "none") for h in s.hs), (s.int8_h, "int8")]:  # noqa: N806
        a = run_diloco(c, s, ckpt, val, H, how)
        log(f"diloco H={H} {how}: val_loss {a.val_loss:.4f} ({a.wall_s:.0f} s)")
        arms.append(a)
    ddp = arms[0]
    for a in arms:
        a.val_loss_ratio_vs_ddp = a.val_loss / ddp.val_loss
        a.bytes_ratio_vs_ddp = ddp.bytes_sent / a.bytes_sent
        if a.compression == "none":
            assert ddp.bytes_sent == a.H * a.bytes_sent, (a.arm, a.H, a.bytes_sent)
    h50 = next(a for a in arms if (a.arm, a.H, a.compression) == ("diloco", s.int8_h, "none"))
    int8 = next(a for a in arms if a.compression == "int8")
    int8_dev = int8.val_loss / h50.val_loss - 1
    n_params = sum(p.numel() for p in ByteLM(s).parameters())
    summary = {
        "goal_h50_within_1.03x_ddp": h50.val_loss_ratio_vs_ddp <= GOAL_H50_VS_DDP,
        "h50_val_loss_ratio_vs_ddp": round(h50.val_loss_ratio_vs_ddp, 4),
        "goal_int8_within_0.5pct_of_fp32": abs(int8_dev) <= GOAL_INT8_VS_FP32,
        "int8_vs_fp32": round(int8_dev, 5),
        "warmup_val_loss": round(ckpt[2], 4),
        "params": n_params,
        "tokens_per_arm": s.steps * s.k * s.batch * s.ctx,
        "total_wall_s": round(time.perf_counter() - t_all, 1),
        "settings": asdict(s),
        "corpus": c.info,
        "host": host(),
    }
    return {"arms": arms, "summary": summary}


def print_table(out: dict[str, Any]) -> None:
    print()
    print("| arm | H | compression | val_loss | vs DDP | bytes_sent | DDP bytes / arm | wall_s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for a in out["arms"]:
        print(
            f"| {a.arm} | {a.H} | {a.compression} | {a.val_loss:.4f} | "
            f"{a.val_loss_ratio_vs_ddp:.4f} | {a.bytes_sent:,} | {a.bytes_ratio_vs_ddp:.1f} | "
            f"{a.wall_s:.0f} |"
        )
    sm = out["summary"]
    print()
    print(
        f"H=50 vs DDP: {sm['h50_val_loss_ratio_vs_ddp']:.4f} (goal <= {GOAL_H50_VS_DDP}): "
        f"{'met' if sm['goal_h50_within_1.03x_ddp'] else 'NOT met'}"
    )
    print(
        f"int8 vs fp32 at H=50: {sm['int8_vs_fp32']:+.3%} (goal within 0.5%): "
        f"{'met' if sm['goal_int8_within_0.5pct_of_fp32'] else 'NOT met'}"
    )
    print(
        f"{sm['params']:,} params, {sm['tokens_per_arm']:,} tokens per arm, "
        f"warm-up val_loss {sm['warmup_val_loss']}, total {sm['total_wall_s']:.0f} s"
    )
    print(sm["host"])


def plot(out: dict[str, Any], s: Settings, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for a in out["arms"]:
        label = (
            "DDP"
            if a.arm == "ddp"
            else f"DiLoCo H={a.H}" + (f" {a.compression}" if a.compression != "none" else "")
        )
        xs = [st * s.k * s.batch * s.ctx / 1e6 for st, _ in a.curve]
        ax.plot(
            xs,
            [v for _, v in a.curve],
            marker="o",
            ms=3,
            ls="--" if a.compression != "none" else "-",
            label=f"{label}: {a.val_loss:.4f}",
        )
    ax.set_xlabel(f"tokens after the warm-up (millions; k={s.k} replicas together)")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title(f"Byte-level LM on the Python stdlib: DDP vs DiLoCo (k={s.k})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = Settings()
    p.add_argument("--json", action="store_true", help="one JSON object per arm, then the summary")
    p.add_argument("--quick", action="store_true", help="a ~1 min smoke run (small sizes)")
    p.add_argument("--plot", metavar="PNG", help="write the validation-loss curves here")
    p.add_argument("--k", type=int, default=d.k)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--ctx", type=int, default=d.ctx)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--val-windows", type=int, default=d.val_windows)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    kw = {
        n: getattr(a, n)
        for n in (
            "k",
            "steps",
            "warmup_steps",
            "batch",
            "ctx",
            "d_model",
            "layers",
            "lr",
            "val_windows",
            "threads",
            "seed",
        )
    }
    if a.quick:
        kw.update(steps=100, warmup_steps=50, batch=8, ctx=64, d_model=64, layers=2, val_windows=64)
    s = Settings(**kw)
    log = (lambda *_: None) if a.json else (lambda msg: print(msg, flush=True))
    out = run(s, log)
    if a.plot:
        plot(out, s, a.plot)
    if a.json:
        for arm in out["arms"]:
            print(json.dumps(asdict(arm)), flush=True)
        print(json.dumps({"summary": out["summary"]}), flush=True)
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
