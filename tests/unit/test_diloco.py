"""DiLoCo's outer loop against exact identities (float64, k = 4, 48 steps).

- H = 1, inner SGD, outer SGD(lr=1, momentum=0) is DDP-SGD with a k-times batch;
- outer SGD(lr=1) with any H is parameter averaging every H steps;
- negative control: inner AdamW with H = 1 is *not* DDP-AdamW;
- Streaming DiLoCo with one fragment is DiLoCo; with several (and tau, alpha),
  every replica ends identical.

k replicas run in threads; :class:`ThreadGroup` is an exact in-process
reducer (sums in a fixed order, so every replica gets the same bits).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rank_threads import run_threads

from phalanx.comm.compress import decode, encode, wire_bytes
from phalanx.train.diloco import DiLoCo, DiLoCoConfig, fragment_of

K, STEPS, BATCH = 4, 48, 8


class ThreadGroup:
    """k replicas in threads: ``average`` waits for all k, sums in rank order."""

    def __init__(self, k: int):
        self.k = k
        self.barrier = threading.Barrier(k)
        self.slots: list[list[torch.Tensor]] = [[] for _ in range(k)]
        self.calls = 0

    def reducer(self, rank: int):
        group = self

        class R:
            def average(self, tensors, *, round, fragment):
                group.slots[rank] = tensors
                group.barrier.wait()
                out = [
                    sum(group.slots[r][i] for r in range(group.k)) / group.k
                    for i in range(len(tensors))
                ]
                group.barrier.wait()
                if rank == 0:
                    group.calls += 1
                return out, group.k

        return R()


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS * K * BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(6, 2, generator=g, dtype=torch.float64))
    return x, y


def model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
    ).double()


def batch(step: int, rank: int, k: int, xy) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``rank``'s slice of step ``step``'s global batch of k*BATCH."""
    x, y = xy
    lo = step * K * BATCH + rank * BATCH * K // k
    n = BATCH * K // k
    return x[lo : lo + n], y[lo : lo + n]


def loss_of(m, x, y):
    return ((m(x) - y) ** 2).mean()


def run_diloco(
    cfg: DiLoCoConfig, inner: Callable, k: int = K, outer=None, finish: bool = False, group=None
) -> tuple[list[torch.nn.Module], ThreadGroup]:
    xy = data()
    group = group or ThreadGroup(k)
    models = [model() for _ in range(k)]

    def work(rank: int) -> None:
        m = models[rank]
        opt = inner(m.parameters())
        d = DiLoCo(m, cfg, group.reducer(rank), outer)
        for s in range(STEPS):
            opt.zero_grad()
            loss_of(m, *batch(s, rank, k, xy)).backward()
            opt.step()
            d.after_inner_step()
        if finish:
            d.finish()

    def free_the_others(e: BaseException) -> None:
        if isinstance(group, ThreadGroup):
            group.barrier.abort()

    run_threads(k, work, free_the_others)
    return models, group


def run_ddp(inner: Callable) -> torch.nn.Module:
    """One model on the whole global batch each step (= DDP with mean-reduced grads)."""
    xy = data()
    m = model()
    opt = inner(m.parameters())
    for s in range(STEPS):
        opt.zero_grad()
        loss_of(m, *batch(s, 0, 1, xy)).backward()
        opt.step()
    return m


def params(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def sgd(lr: float = 0.05):
    return lambda ps: torch.optim.SGD(ps, lr=lr)


def outer_sgd(lr: float = 1.0):
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.0)


def test_h1_inner_sgd_outer_sgd_lr1_is_ddp_sgd_with_a_k_times_batch():
    models, group = run_diloco(DiLoCoConfig(H=1), sgd(), outer=outer_sgd())
    want = params(run_ddp(sgd()))
    for m in models:
        torch.testing.assert_close(params(m), want, rtol=0, atol=1e-12)
    assert group.calls == STEPS


@pytest.mark.parametrize("h", [3, 8])
def test_outer_sgd_lr1_is_parameter_averaging(h: int):
    H = h  # noqa: N806 (the paper's symbol)
    cfg = DiLoCoConfig(H=H)
    models, group = run_diloco(cfg, sgd(), outer=outer_sgd())
    # The same k replicas, averaging their parameters by hand every H steps.
    xy = data()
    ref = [model() for _ in range(K)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in ref]
    for s in range(STEPS):
        for r, (m, o) in enumerate(zip(ref, opts, strict=True)):
            o.zero_grad()
            loss_of(m, *batch(s, r, K, xy)).backward()
            o.step()
        if (s + 1) % H == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in ref), strict=True):
                    mean = sum(p.detach().clone() for p in ps) / K
                    for p in ps:
                        p.copy_(mean)
    for got, want in zip(models, ref, strict=True):
        torch.testing.assert_close(params(got), params(want), rtol=0, atol=1e-12)
    assert group.calls == STEPS // H


def test_negative_control_inner_adamw_h1_is_not_ddp_adamw():
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    models, _ = run_diloco(DiLoCoConfig(H=1), adamw, outer=outer_sgd())
    diff = (params(models[0]) - params(run_ddp(adamw))).abs().max()
    assert diff > 1e-4, "per-replica Adam normalisation must make DiLoCo differ from DDP-AdamW"


def test_streaming_with_one_fragment_is_diloco():
    a, _ = run_diloco(DiLoCoConfig(H=6), sgd())
    b, _ = run_diloco(DiLoCoConfig(H=6, fragments=1, tau=0), sgd())
    for x, y in zip(a, b, strict=True):
        assert torch.equal(params(x), params(y))


@pytest.mark.parametrize(("fragments", "tau", "alpha"), [(3, 0, 0.0), (2, 1, 0.5)])
def test_streaming_fragments_end_identical_on_every_replica(fragments: int, tau: int, alpha: float):
    cfg = DiLoCoConfig(H=6, fragments=fragments, tau=tau, alpha=alpha)
    models, group = run_diloco(cfg, sgd(), finish=True)
    first = params(models[0])
    for m in models[1:]:
        assert torch.equal(params(m), first)
    per_round = STEPS // cfg.H
    assert group.calls >= per_round * fragments  # plus the final flush
    # Training happened, and all replicas moved from the initial point.
    assert not torch.equal(first, params(model()))


def test_diloco_state_round_trips_and_rejects_another_model():
    m = model()
    d = DiLoCo(m, DiLoCoConfig(H=2), ThreadGroup(1).reducer(0))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xy = data()
    for s in range(3):
        opt.zero_grad()
        loss_of(m, *batch(s, 0, 1, xy)).backward()
        opt.step()
        d.after_inner_step()
    sd = d.state_dict()
    m2 = model()
    d2 = DiLoCo(m2, DiLoCoConfig(H=2), ThreadGroup(1).reducer(0))
    d2.load_state_dict(sd)
    assert d2.inner_steps == 3 and d2.rounds == 1
    for g1, g2 in zip(d.global_params, d2.global_params, strict=True):
        assert torch.equal(g1, g2)
    other = DiLoCo(torch.nn.Linear(2, 2).double(), DiLoCoConfig(H=2), ThreadGroup(1).reducer(0))
    with pytest.raises(ValueError, match="global copy"):
        other.load_state_dict(sd)


def test_config_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="divisible by fragments"):
        DiLoCoConfig(H=10, fragments=3)
    with pytest.raises(ValueError, match="tau must be in"):
        DiLoCoConfig(H=10, fragments=2, tau=5)
    with pytest.raises(ValueError, match="fragments must be <="):
        fragment_of(["a", "b"], 3)


@pytest.mark.parametrize(
    ("how", "tol", "ratio"),
    [("none", 0, 1), ("fp16", 1e-3, 2), ("bf16", 1e-2, 2), ("int8", 2e-2, 4)],
)
def test_compression_round_trip_and_size(how, tol, ratio):
    t = torch.randn(1000, dtype=torch.float32)
    wire = encode(t, how)
    back = decode(wire, how, t)
    assert back.dtype == torch.float32 and back.shape == t.shape
    assert (back - t).abs().max() <= tol * (t.max() - t.min()) + 1e-7
    assert wire_bytes(wire) <= t.numel() * 4 // ratio + 8


# -- the decoupled exchange through an object store -------------------------------------


def store_group(url: str, **kw):
    from phalanx.transport.diloco_rounds import ObjectStoreAllReduce

    made: list[ObjectStoreAllReduce] = []

    class G:
        calls = 0

        def reducer(self, rank: int):
            r = ObjectStoreAllReduce(url, f"r{rank}", min_replicas=K, grace_s=0.0, **kw)
            made.append(r)
            return r

    return G(), made


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_object_store_rounds_are_bit_identical_to_the_in_process_reducer(scheme, tmp_path):
    import uuid

    url = f"memory://diloco-{uuid.uuid4().hex[:6]}" if scheme == "memory" else f"file://{tmp_path}"
    cfg = DiLoCoConfig(H=4)
    want, _ = run_diloco(cfg, sgd())
    group, made = store_group(url)
    got, _ = run_diloco(cfg, sgd(), group=group)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(params(a), params(b))
    assert all(r.corrupt == 0 and r.left_out == 0 for r in made)
    assert made[0].bytes_sent == (STEPS // 4) * sum(p.numel() * 8 for p in model().parameters())


def _rounds(
    reducers, tensors_of, rounds: int, delay: Callable[[int, int], float] = lambda r, i: 0.0
):
    """Each reducer averages ``tensors_of(rank, round)`` for ``rounds`` rounds in a thread."""
    import time

    out: dict[tuple[int, int], tuple[list[torch.Tensor], int]] = {}

    def work(rank: int) -> None:
        for rnd in range(rounds):
            time.sleep(delay(rank, rnd))
            out[(rank, rnd)] = reducers[rank].average(tensors_of(rank, rnd), round=rnd, fragment=0)

    run_threads(len(reducers), work)
    return out


def test_a_corrupt_object_is_left_out_by_everyone_and_counted(tmp_path):
    from phalanx.transport.diloco_rounds import ObjectStoreAllReduce

    class Flaky(ObjectStoreAllReduce):
        def pack(self, tensors, meta):
            raw = bytearray(super().pack(tensors, meta))
            if meta.get("replica") == "r2":
                raw[-3] ^= 0xFF  # a flipped byte in the data: the checksum catches it
            return bytes(raw)

    reds = [Flaky(f"file://{tmp_path}", f"r{i}", min_replicas=2, grace_s=0.05) for i in range(3)]
    out = _rounds(reds, lambda rank, rnd: [torch.full((5,), float(rank + 1))], 1)
    for rank in range(3):
        avg, n = out[(rank, 0)]
        assert n == 2 and torch.equal(avg[0], torch.full((5,), 1.5))
    # The proposer read it, found it corrupt and left it out of the members: nobody
    # else had to read it, and no reader averaged it.
    assert all(r.last_members == ["r0", "r1"] for r in reds)
    assert sum(r.corrupt for r in reds) >= 1


def test_stray_and_corrupt_files_never_count_as_members(tmp_path):
    """Issue 20: any ``*.st`` in a round's directory counted as a member (round 6 listed
    ``zz-garbage-r3``), and a stray file could make up ``min_replicas``. Only the job's
    slot names count, and only objects that pass their checksum."""
    import time

    from phalanx.transport.diloco_rounds import ObjectStoreAllReduce

    def red(name: str, **kw):
        return ObjectStoreAllReduce(
            f"file://{tmp_path}", name, slots=["r0", "r1", "r2"], grace_s=0.05, **kw
        )

    key = red("r0").key(0, 0)
    Path(key).mkdir(parents=True)
    (Path(key) / "zz-garbage-r3.st").write_bytes(b"stray")  # no slot of this job
    good = red("r2").pack({"0.v": torch.ones(5)}, {"replica": "r2"})
    (Path(key) / "r2.st").write_bytes(good[:-4] + b"\xff\xff\xff\xff")  # a slot's, corrupt
    # r0 alone, min_replicas 2: the two files must not make up the count. The round
    # is decided only at its deadline, with r0 alone.
    r0 = red("r0", min_replicas=2, timeout_s=1.0)
    t0 = time.monotonic()
    avg, n = r0.average([torch.full((5,), 4.0)], round=0, fragment=0)
    assert time.monotonic() - t0 >= 1.0  # waited for a second valid object, in vain
    assert r0.last_members == ["r0"] and n == 1 and torch.equal(avg[0], torch.full((5,), 4.0))
    # With r1 too (round 1), the round is decided by the two slots, the files left out.
    reds = [red(f"r{i}", min_replicas=2) for i in range(2)]
    for r in reds:
        Path(r.key(1, 0)).mkdir(parents=True, exist_ok=True)
    (Path(reds[0].key(1, 0)) / "zz-garbage-r3.st").write_bytes(b"stray")
    (Path(reds[0].key(1, 0)) / "r2.st").write_bytes(b"corrupt")
    out = {}
    for_rank = lambda rank, rnd: [torch.full((5,), float(rank + 1))]  # noqa: E731

    def work(rank: int) -> None:
        out[rank] = reds[rank].average(for_rank(rank, 1), round=1, fragment=0)

    run_threads(2, work)
    assert all(r.last_members == ["r0", "r1"] for r in reds)
    assert all(n == 2 and torch.equal(avg[0], torch.full((5,), 1.5)) for avg, n in out.values())


def test_a_replica_that_misses_the_deadline_is_left_out_and_catches_up(tmp_path):
    from phalanx.transport.diloco_rounds import ObjectStoreAllReduce

    reds = [
        ObjectStoreAllReduce(
            f"file://{tmp_path}", f"r{i}", min_replicas=3, grace_s=0.05, aggregator="r0"
        )
        for i in range(4)
    ]
    late = lambda rank, rnd: 0.6 if (rank, rnd) == (3, 1) else 0.0  # noqa: E731
    out = _rounds(reds, lambda rank, rnd: [torch.tensor([rank * 10.0 + rnd])], 2, late)
    avg, n = out[(3, 1)]
    assert n == 3 and torch.equal(avg[0], torch.tensor([(0 + 10 + 20) / 3 + 1]))
    assert all(torch.equal(out[(r, 1)][0][0], avg[0]) for r in range(4))  # same result for all
    assert reds[3].left_out == 1 and all(r.left_out == 0 for r in reds[:3])
    assert out[(0, 0)][1] == 4
    # Aggregator mode: non-aggregators read the one result object of each round; only
    # the aggregator averages. (Bytes read are no measure of it: any replica may be the
    # one that decides a round's members, reading every object to check it.)
    assert [r.averaged for r in reds] == [2, 0, 0, 0]
