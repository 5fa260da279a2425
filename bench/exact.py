"""Exact reduction benchmark (``train.exact_reduction``): what a bit-exact gradient sum
costs a step and the wire, and whether a chaos run really ends with a calm run's bits.

    python bench/exact.py [--json] [--rounds 2] [--steps 6] [--models mlp,qwen2]
                          [--no-chaos]

Figures (every ratio against a baseline measured in the same run, on the same
machine, interleaved):

- ``exact_step_ratio``: median step time with the exact reduction over the float
  one, per model. A step is the FT data-parallel step of one replica: its share
  of the constant global batch in micro-batches (:class:`phalanx.train.share.
  Accumulator`, as the manager runs it), the bucketed all-reduce with the vote
  (:class:`~phalanx.train.grads.GradBuffer`, or :class:`~phalanx.train.
  exact_grads.ExactGrads`: a slot per micro-batch, the exponents' MAX all-reduce,
  the int64 sum), and AdamW. 3 replicas, one process each on one torch thread,
  over a real gloo group (:class:`~phalanx.comm.torch_pg.TorchCommunicator`). The
  rounds alternate float and exact; the ratio is taken per round and the median
  over rounds reported. No controller: the quorum round trip, the same in both
  arms, would only dilute the ratio.
  - ``mlp``: the FT-DDP benchmark's model and batch (``bench/ft_ddp.py``: 256 ->
    2048 -> 2048 -> 256 MLP, 5.2 M parameters, global batch 96 in micro-batches
    of 32, float32);
  - ``qwen2``: a randomly initialised ``transformers`` Qwen2ForCausalLM of 19.8 M
    parameters (6 layers, hidden 384, vocabulary 16384, tied embeddings) built from
    its config in the process, next-token loss on random tokens, global batch 6
    sequences of 64 tokens in micro-batches of 1.
- ``exact_bytes_ratio``: bytes handed to the collectives per step (exponents, sums
  and vote) over the float step's (buckets and vote), per model.
- ``chaos_bit_identical``: the built-in FT job (``phalanx controller`` and 3
  ``phalanx replica`` processes, float32 MLP, exact reduction) run calm, then with
  one replica SIGKILLed at step 10 and started again at once (it heals): true when
  every final model and optimizer tensor equals the calm run's, byte for byte.

Every child runs in its own session and is killed by process group at the end;
every port comes from binding port 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPLICAS = 3
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"batch": 96, "micro": 32, "warmup": 2},
    "qwen2": {"batch": 6, "micro": 1, "seq": 64, "warmup": 1},
    "qwen2-gpu": {"batch": 48, "micro": 8, "seq": 256, "warmup": 3},
}
"""Per model: global batch, micro-batch, sequence length, warm-up steps. ``qwen2-gpu``
(``--gpu``) is the same model with a batch that keeps a GPU busy."""
CHAOS_STEPS, KILL_AT = 120, 10
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
for _k in ("PHALANX_TOKEN", "PHALANX_CONTROLLER"):
    ENV.pop(_k, None)


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


# -- one replica of the step benchmark (its own process) ------------------------------


def build(model: str, spec: dict[str, Any], device: str = "cpu") -> tuple[Any, Any]:
    """(model, compute(positions, scale) -> loss) with the same weights in every process."""
    import torch

    torch.manual_seed(0)
    dev = torch.device(device)
    if model == "mlp":
        sys.path.insert(0, str(HERE.parent))
        from ft_ddp_workers import SEED, train_section
        from phalanx.jobs.mlp import build_data, build_model, make_compute

        tc = train_section()
        net = build_model(tc, SEED).to(dev)
        x, y = build_data(tc, SEED)
        return net, make_compute(net, x.to(dev), y.to(dev))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=16384,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=spec["seq"],
        tie_word_embeddings=True,
    )
    net = Qwen2ForCausalLM(cfg).float().to(dev)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (256, spec["seq"]), generator=g).to(dev)

    def compute(positions: list[int], scale: float) -> float:
        ids = tokens[torch.as_tensor(positions, device=dev) % len(tokens)]
        out = net(input_ids=ids, labels=ids)
        loss = out.loss * len(positions)
        (loss * scale).backward()
        return float(loss.detach())

    return net, compute


def worker(spec: dict[str, Any]) -> None:
    import torch

    from phalanx.comm.torch_pg import TorchCommunicator
    from phalanx.data.sampler import ElasticSampler
    from phalanx.train.exact_grads import ExactGrads
    from phalanx.train.grads import GradBuffer
    from phalanx.train.share import Accumulator

    torch.set_num_threads(1)
    m, device = MODELS[spec["model"]], spec.get("device", "cpu")
    net, compute = build(spec["model"].split("-")[0], m, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    rank, k, exact = spec["rank"], spec["replicas"], spec["exact"]
    grads = ExactGrads(net) if exact else GradBuffer(net)
    sampler = ElasticSampler(4096, seed=0)
    acc = Accumulator(grads, sampler, m["batch"], m["micro"] if exact else None)
    comm = TorchCommunicator(120.0, torch.device(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    comm.configure(spec["store"], f"bench-{spec['tag']}", rank, k)

    def run(positions: list[int]) -> float:
        total = 0.0
        for i in range(0, len(positions), m["micro"]):
            total += compute(positions[i : i + m["micro"]], 1.0 / m["batch"])
        return total

    times, exchanges, sent = [], [], []
    for step in range(m["warmup"] + spec["steps"]):
        comm.allreduce([torch.zeros(1, device=device)], "sum")  # all start the step together
        sync()
        t0 = time.perf_counter()
        loss, _ = acc.compute(step, rank, k, run)
        before = grads.units.sum.bytes_sent if exact else 0
        sync()
        t1 = time.perf_counter()
        total = grads.allreduce(comm, k, loss, vote=True)
        sync()
        t2 = time.perf_counter()
        opt.step()
        sampler.commit(m["batch"])
        sync()
        times.append(time.perf_counter() - t0)
        exchanges.append(t2 - t1)
        if exact:
            sent.append(grads.units.sum.bytes_sent - before)
        else:
            sent.append(sum(b.numel() * b.element_size() for b in grads.buckets) + 16)
        if not grads.vote_ok or total != total:
            raise RuntimeError(f"step {step} did not commit: loss {total}")
    emit(
        event="done",
        step_s=statistics.median(times[m["warmup"] :]),
        exchange_s=statistics.median(exchanges[m["warmup"] :]),
        bytes=sent[-1],
        params=sum(p.numel() for p in net.parameters()),
    )
    comm.abort()


# -- the parent ---------------------------------------------------------------------


def spawn(args: list[str], log: Path) -> subprocess.Popen[str]:
    with log.open("wb") as err:
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=ENV,
            text=True,
            start_new_session=True,
        )


def kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)


def step_arm(
    model: str, exact: bool, steps: int, tmp: Path, tag: str, device: str = "cpu"
) -> dict[str, Any]:
    """One arm: REPLICAS worker processes over one gloo group (one process over an
    NCCL group of one on a GPU); the slowest replica's figures."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    try:
        replicas = 1 if device == "cuda" else REPLICAS
        for r in range(replicas):
            spec = {
                "model": model,
                "device": device,
                "exact": exact,
                "rank": r,
                "replicas": replicas,
                "steps": steps,
                "store": f"127.0.0.1:{store.port}",
                "tag": tag,
            }
            cmd = [sys.executable, str(HERE), "worker", json.dumps(spec)]
            procs.append(spawn(cmd, tmp / f"{tag}-r{r}.err"))
        outs = []
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                err = (tmp / f"{tag}-r{r}.err").read_text()[-2000:]
                raise RuntimeError(f"{tag} rank {r} failed ({p.returncode}): {err}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        # A step ends when the slowest replica's does: the max over replicas.
        return {
            **outs[0],
            "step_s": max(o["step_s"] for o in outs),
            "exchange_s": max(o["exchange_s"] for o in outs),
        }
    finally:
        for p in procs:
            kill(p)
        del store


def step_figures(
    model: str, rounds: int, steps: int, tmp: Path, device: str = "cpu"
) -> dict[str, Any]:
    ratios, arms = [], {"float": [], "exact": []}
    exchange: dict[str, list[float]] = {"float": [], "exact": []}
    for i in range(rounds):
        order = [False, True] if i % 2 == 0 else [True, False]
        got = {}
        for exact in order:
            name = "exact" if exact else "float"
            got[name] = step_arm(model, exact, steps, tmp, f"{model}-{name}-{i}", device)
            arms[name].append(got[name]["step_s"])
            exchange[name].append(got[name]["exchange_s"])
        ratios.append(got["exact"]["step_s"] / got["float"]["step_s"])
    return {
        "model": model,
        "device": device,
        "replicas": 1 if device == "cuda" else REPLICAS,
        "params": got["float"]["params"],
        "exact_step_ratio": round(statistics.median(ratios), 3),
        "round_ratios": [round(r, 3) for r in ratios],
        "float_step_s": [round(t, 4) for t in arms["float"]],
        "exact_step_s": [round(t, 4) for t in arms["exact"]],
        "float_exchange_s": [round(t, 4) for t in exchange["float"]],
        "exact_exchange_s": [round(t, 4) for t in exchange["exact"]],
        "exact_bytes_ratio": round(got["exact"]["bytes"] / got["float"]["bytes"], 4),
        "float_bytes": got["float"]["bytes"],
        "exact_bytes": got["exact"]["bytes"],
    }


# -- the chaos run --------------------------------------------------------------------

JOB = """[job]
id = "bench-exact-{tag}"
seed = 7

[timeouts]
collective_s = 1.0
heartbeat_s = 4.0
heartbeat_interval_s = 0.2
suspect_grace_s = 0.5
quorum_s = 60.0

[roles.policy]
min_replicas = 1
n_init_replicas = 3
join_timeout_s = 0.5

[train]
steps = {steps}
dtype = "float32"
exact_reduction = true
in_dim = 8
hidden = [32]
out_dim = 2
dataset_size = 512
global_batch_size = 24
micro_batch_size = 4
optimizer = "adamw"
lr = 0.01
step_delay_s = {delay}
"""


def read_steps(p: subprocess.Popen[str], until: int, lines: list[dict[str, Any]]) -> None:
    """Read ``p``'s JSON lines into ``lines`` until a step >= ``until`` or ``done``."""
    assert p.stdout is not None
    for line in p.stdout:
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        lines.append(e)
        if e["event"] == "done" or (e["event"] == "step" and e["step"] >= until):
            return
    raise RuntimeError(f"replica exited ({p.wait()}) before step {until}")


def job_run(tmp: Path, tag: str, chaos: bool) -> tuple[list[Path], int]:
    """A calm or chaos run of the built-in job; the final state files (of the
    replicas that ended on the job's last step) and the restarts."""
    d = tmp / tag
    d.mkdir()
    cfg = d / "job.toml"
    cfg.write_text(JOB.format(tag=tag, steps=CHAOS_STEPS, delay=0.02))
    state = d / "state"
    cli = [sys.executable, "-m", "phalanx.cli"]
    ctl = spawn(
        [*cli, "controller", "--config", str(cfg), "--state-dir", str(state), "--port", "0"],
        d / "controller.err",
    )
    procs = [ctl]

    def replica(name: str, n: int) -> tuple[subprocess.Popen[str], Path]:
        out = d / f"{name}-{n}.safetensors"
        args = ["--config", str(cfg), "--controller", str(state), "--name", name]
        p = spawn([*cli, "replica", *args, "--out", str(out)], d / f"{name}-{n}.err")
        procs.append(p)
        return p, out

    try:
        deadline = time.monotonic() + 120
        while not (state / "url").exists():
            if time.monotonic() > deadline or ctl.poll() is not None:
                raise RuntimeError(f"the controller did not start: {(d / 'controller.err')}")
            time.sleep(0.05)
        reps = [replica(n, 0) for n in "abc"]
        outs = [out for _, out in reps]
        restarts = 0
        if chaos:
            victim, _ = reps[2]
            read_steps(victim, KILL_AT, [])
            os.killpg(victim.pid, signal.SIGKILL)
            again, out = replica("c", 1)
            outs[2], restarts = out, 1
            reps[2] = (again, out)
        for p, _ in reps:
            lines: list[dict[str, Any]] = []
            read_steps(p, CHAOS_STEPS + 1, lines)
        # A restart that found the job finished (it came back too late) writes none.
        return [o for o in outs if o.exists()], restarts
    finally:
        for p in procs:
            kill(p)


def chaos_figures(tmp: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    calm, _ = job_run(tmp, "calm", chaos=False)
    chaos, restarts = job_run(tmp, "chaos", chaos=True)
    want = load_file(str(calm[0]))
    same = len(calm) == 3 and len(chaos) >= 2
    for f in [*calm, *chaos]:
        got = load_file(str(f))
        same = same and got.keys() == want.keys()
        same = same and all(torch.equal(got[k], want[k]) for k in want)
    return {
        "chaos_bit_identical": same,
        "chaos_steps": CHAOS_STEPS,
        "restarts": restarts,
        "restart_rejoined": len(chaos) == 3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per arm")
    ap.add_argument("--models", default="mlp,qwen2")
    ap.add_argument("--no-chaos", action="store_true")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="also qwen2-gpu on one CUDA device (an NCCL group of one: the conversions' "
        "cost alone, no traffic)",
    )
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as t:
        tmp = Path(t)
        for model in [m for m in args.models.split(",") if m]:
            results.append(step_figures(model, args.rounds, args.steps, tmp))
        if args.gpu:
            results.append(step_figures("qwen2-gpu", args.rounds, args.steps, tmp, "cuda"))
        if not args.no_chaos:
            results.append(chaos_figures(tmp))
    for r in results:
        if args.json:
            print(json.dumps(r))
        elif "model" in r:
            print(
                f"{r['model']:9s} {r['device']:4s} x{r['replicas']} {r['params'] / 1e6:5.1f} M "
                f"params  exact_step_ratio "
                f"{r['exact_step_ratio']:.3f} (rounds {r['round_ratios']})  exact_bytes_ratio "
                f"{r['exact_bytes_ratio']:.3f}  float {r['float_step_s']} s  exact "
                f"{r['exact_step_s']} s"
            )
        else:
            print(f"chaos_bit_identical {r['chaos_bit_identical']} ({r['restarts']} restart)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
