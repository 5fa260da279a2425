"""One rank of a policy replica of 2 ranks, for the sharded-policy numerics test
(started by ``python -m phalanx.launch.ranks --nproc 2 -- python THIS OUT``), or
of N ranks with tensor parallelism over T of them (``... THIS OUT T``: a llama
policy, TP over T ranks, FSDP2 over N / T, as ``[replica] tp = T`` runs it).

Every rank builds the job's policy model (float64), shards it as a sharded
policy replica does (:func:`phalanx.jobs.replica_ranks.wrap`), and computes the GRPO gradients of one fixed batch
through :class:`phalanx.rl.trainer.PolicyTrainer` under a real
:class:`phalanx.train.hsdp.HSDPManager`. Rank 0 also computes them on an
unsharded copy of the same model, and writes what it found as JSON to OUT: the
largest gradient difference, the gathered weights (:func:`full_weights`)
against the unsharded model, and whether packing them cost a copy."""

from __future__ import annotations

import json
import random
import sys

import torch

torch.set_default_dtype(torch.float64)

from phalanx.comm.torch_pg import TorchCommunicator  # noqa: E402
from phalanx.config.rl import RLConfig  # noqa: E402
from phalanx.jobs.policy_ranks import full_weights  # noqa: E402
from phalanx.jobs.replica_ranks import wrap  # noqa: E402
from phalanx.protocol.rl import Completion, RolloutPayload  # noqa: E402
from phalanx.rl.grpo import group_advantages, rows_to_train  # noqa: E402
from phalanx.rl.model import build_model  # noqa: E402
from phalanx.rl.step import backward_rows  # noqa: E402
from phalanx.rl.tokenizer import task_tokenizer  # noqa: E402
from phalanx.rl.trainer import PolicyTrainer, completions_of  # noqa: E402
from phalanx.train.hsdp import HSDPManager, RankClient, ReplicaRanks  # noqa: E402
from phalanx.train.shards import clip_grad_norm  # noqa: E402
from phalanx.transport.collective import pack  # noqa: E402

PROMPTS, GROUP = 3, 3
CLIP = 0.01
"""Below the batch's gradient norm: clipping scales every gradient."""


def batch(vocab: int) -> list[tuple[int, RolloutPayload]]:
    """3 prompts x 3 completions of different lengths, every reward distinct (so
    that every row has an advantage and is trained); the same on every rank."""
    rng = random.Random(7)
    rows = []
    for p in range(PROMPTS):
        comps = []
        for _ in range(GROUP):
            n = rng.randint(2, 5)
            comps.append(
                Completion(
                    prompt_ids=[rng.randrange(3, vocab) for _ in range(4)],
                    token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(0.5, 3.0) for _ in range(n)],
                    finished=True,
                    reward=rng.random(),
                )
            )
        rows.append((p, RolloutPayload(rollout_id=f"p{p}.0", version=0, completions=comps)))
    return rows


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective), or a tensor every rank holds whole (a
    TP-replicated norm when FSDP has one rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    out = sys.argv[1]
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    arch = "llama" if tp > 1 else "gpt2"
    rl = RLConfig.model_validate(
        {
            "task": {"name": "sort4"},
            "model": {"arch": arch, "hidden_size": 32, "num_layers": 2, "num_heads": 4},
            "grpo": {
                "prompts_per_step": PROMPTS,
                "group_size": GROUP,
                "micro_batch_size": 2,
                "max_new_tokens": 5,
            },
        }
    )
    ranks = ReplicaRanks(60.0, tp=tp)
    tok = task_tokenizer(rl.task)
    torch.manual_seed(0)
    model = wrap(build_model(rl.model, tok, torch.device("cpu")).double(), ranks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = RankClient("policy", "numerics", ranks.rank)
    manager = HSDPManager(
        client, ranks, TorchCommunicator(30.0), model, opt, None, global_batch_size=PROMPTS * GROUP
    )
    rows = batch(tok.vocab_size)
    trainer = PolicyTrainer(rl, manager, model, tok.pad_id)
    stats = trainer.compute(rows)
    tokens = ranks.sum([stats["train_tokens"]])[0]
    grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
    total = clip_grad_norm(list(model.parameters()), CLIP)
    clipped = {n: _whole(p.grad) for n, p in model.named_parameters()}
    snapshot = full_weights(model, keep=ranks.leader)
    if ranks.leader:
        torch.manual_seed(0)
        plain = build_model(rl.model, tok, torch.device("cpu")).double()
        comps, rewards = completions_of(rows)
        adv = group_advantages(torch.tensor(rewards), GROUP, rl.grpo.adv_eps)
        keep = rows_to_train(adv, rl.grpo.kl_coef)
        n_tokens = sum(len(c.token_ids) for c in comps)
        ref = backward_rows(
            plain, comps, adv, keep, g=rl.grpo, pad_id=tok.pad_id, num_tokens=n_tokens
        )
        named = dict(plain.named_parameters())
        plain_grads = {n: named[n].grad.clone() for n in grads}
        plain_total = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP))
        assert snapshot is not None
        state = plain.state_dict()
        report = {
            "rows": len(keep),
            "grad_diff": max((grads[n] - plain_grads[n]).abs().max().item() for n in grads),
            "norm_diff": abs(total - plain_total),
            "clipped_diff": max((clipped[n] - named[n].grad).abs().max().item() for n in grads),
            "grad_norm": sum(float(plain_grads[n].norm()) for n in grads),
            "tokens": tokens,
            "tokens_plain": ref["train_tokens"],
            "weights_diff": max((snapshot[k] - state[k]).abs().max().item() for k in state),
            "names_equal": sorted(snapshot) == sorted(state),
            "dtensor_dims": max(
                (p.device_mesh.ndim for p in model.parameters() if hasattr(p, "device_mesh")),
                default=0,
            ),
            "packed_in_place": pack(snapshot).data_ptr() == snapshot.flat.data_ptr(),
        }
        with open(out, "w") as f:
            json.dump(report, f)
    manager.close()
    ranks.close()


if __name__ == "__main__":
    main()
