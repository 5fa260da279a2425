"""Tensor parallelism for Hugging Face models inside a replica, under FSDP2
(``[replica] ranks = N, tp = T``: FSDP over N / T, TP over T).

The plan is transformers' own: every ``*ForCausalLM`` whose architecture
supports tensor parallelism names it in ``model._tp_plan`` (module name
patterns, ``layers.*.self_attn.q_proj``, to a style: ``colwise``,
``rowwise``, ``colwise_gather_output``). It is applied with torch's DTensor
``parallelize_module`` on the ``"tp"`` dimension of the replica's
``(dp, tp)`` device mesh (Megatron-style: the attention's q/k/v and the
MLP's gate/up projections are column-parallel, each rank owning whole heads;
the attention's output and the MLP's down projection are row-parallel, with
an all-reduce after them), then FSDP2 shards every decoder layer and the root
over the ``"dp"`` dimension, as :func:`~phalanx.train.shards.shard_model`
does for a replica without TP (torchtitan's 2-D order: TP first, then FSDP).

Norms stay replicated over the TP ranks: their inputs are replicated there,
so each TP rank computes the same gradient for them. The output head is
column-parallel with its logits gathered, and an untied input embedding is
split by vocabulary (``embedding_rowwise``), unless the two are tied
(``tie_word_embeddings``): sharding one of two tied uses would untie them,
so both stay replicated then.

The ranks of one TP group compute the same micro-batches (their activations
are one computation): the replica's share of the global batch is split over
its ``dp`` ranks only (:attr:`~phalanx.train.hsdp.ReplicaRanks.dp_rank`).

Rank ``r`` of every replica of one layout holds the same shards, so a
joiner's rank heals from its counterpart's, and gradients are summed across
replicas shard by shard, as without TP. Checkpoints are DCP's, by global
tensor: they load under any other layout.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_rep",
    "embedding_rowwise",
)
"""transformers' TP styles that map onto torch's Colwise/RowwiseParallel."""


class TPError(ValueError):
    """The model cannot be tensor-parallel at this degree (one line: why, and the fix)."""


def plan_of(model: torch.nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan, ``{module name pattern: style}``, from
    transformers (``model._tp_plan``, the architecture's ``base_model_tp_plan``
    under the base model's prefix)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        plan = {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
    return plan


def check(model: torch.nn.Module, tp: int, what: str = "replica.tp") -> dict[str, str]:
    """The plan this model is parallelized with at degree ``tp``, or
    :class:`TPError` when the architecture has none or ``tp`` does not divide
    its heads, its key/value heads, its MLP or (for an untied head) its
    vocabulary."""
    arch = type(model).__name__
    plan = plan_of(model)
    check_config(getattr(model, "config", None), tp, what, arch, has_plan=bool(plan))
    if _tied(model):  # both tied uses stay replicated (module doc)
        tied = {_module_name(model, model.get_input_embeddings), _module_name(model, None)}  # type: ignore[arg-type]
        plan = {k: v for k, v in plan.items() if not any(_matches(k, n) for n in tied)}
    odd = sorted({s for s in plan.values() if s not in STYLES})
    if odd:
        raise TPError(
            f"{what} = {tp}: {arch}'s tensor-parallel plan uses style(s) {odd}, which phalanx "
            f"does not apply (it applies {list(STYLES)}). Set {what} = 1 for this model."
        )
    return plan


def check_config(
    cfg: Any, tp: int, what: str = "replica.tp", arch: str = "", has_plan: bool | None = None
) -> None:
    """:func:`check`'s tests that a model's config answers (``cfg``, a transformers
    ``PretrainedConfig``): a plan (``has_plan``, or the config's
    ``base_model_tp_plan``), and ``tp`` dividing the heads, key/value heads, MLP and,
    for an untied head, the vocabulary. Lets ``phalanx run`` refuse a model before
    it starts any rank (:func:`check_dir`)."""
    arch = arch or ",".join(getattr(cfg, "architectures", None) or []) or "the model"
    if has_plan is None:
        has_plan = bool(getattr(cfg, "base_model_tp_plan", None))
    if not has_plan:
        raise TPError(
            f"{what} = {tp}: {arch} has no tensor-parallel plan in transformers (its config "
            f"names no base_model_tp_plan). Use an architecture that has one (Llama, Qwen2, "
            f'Qwen3, Mistral, ...; model.arch = "llama" for a model built from config), or '
            f"set {what} = 1 and shard with FSDP alone."
        )
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    mlp = getattr(cfg, "intermediate_size", None)
    for name, n in (("attention heads", heads), ("key/value heads", kv), ("MLP width", mlp)):
        if n is not None and n % tp:
            raise TPError(
                f"{what} = {tp} must divide the model's {name} ({n}): each TP rank owns "
                f"an equal part. Pick {what} among the divisors of {n}."
            )
    vocab = getattr(cfg, "vocab_size", None)
    if not getattr(cfg, "tie_word_embeddings", False) and vocab is not None and vocab % tp:
        raise TPError(
            f"{what} = {tp} must divide the model's vocabulary ({vocab}): the embedding and "
            f"the output head are split by vocabulary over the TP ranks. Pick {what} among "
            f"the divisors of {vocab}, or pad the vocabulary."
        )


def check_dir(path: str, tp: int, what: str = "replica.tp") -> None:
    """:func:`check_config` on the model saved in directory ``path`` (its
    ``config.json``; no weights are read). TPError in one line."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return  # (the replica's load says what is wrong with the directory, in one line)
    check_config(cfg, tp, what)


def parallelize(
    model: torch.nn.Module, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None
) -> torch.nn.Module:
    """``model`` tensor-parallel over ``tp_mesh`` (its plan, :func:`check`), then
    FSDP2-sharded over ``dp_mesh`` when that has more than one rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from phalanx.train.shards import shard_model

    plan = check(model, tp_mesh.size())
    styles: dict[str, Any] = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    }
    names = [n for n, _ in model.named_modules()]
    parallel: dict[str, Any] = {}
    for pattern, style in plan.items():
        for name in names:
            if _matches(pattern, name):
                parallel[name] = styles[style]
    if not parallel:
        raise TPError(
            f"the tensor-parallel plan of {type(model).__name__} matches none of its modules "
            f"({sorted(plan)[:3]}...): the model is not laid out as its architecture says."
        )
    parallelize_module(model, tp_mesh, parallel)
    if dp_mesh is not None and dp_mesh.size() > 1:
        shard_model(model, dp_mesh)
    return model


def _matches(pattern: str, name: str) -> bool:
    """transformers' plan patterns: ``*`` stands for one layer index."""
    return fnmatch.fnmatchcase(name, pattern) and name.count(".") == pattern.count(".")


def _module_name(model: torch.nn.Module, get: Any) -> str:
    """The name in ``model`` of the module ``get()`` returns (None: the output head)."""
    module = (get or model.get_output_embeddings)()  # type: ignore[operator]
    for name, m in model.named_modules():
        if m is module:
            return name
    return ""


def _tied(model: torch.nn.Module) -> bool:
    """Whether the output head shares its weight with the input embedding."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    emb, head = get_in(), get_out()
    return emb is not None and head is not None and head.weight is emb.weight
