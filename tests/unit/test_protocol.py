"""The wire contract (phalanx.protocol): every message is strict, closed and
bounded, and the controller's OpenAPI spec is generated from these models."""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from phalanx.protocol.base import MAX_INT, Wire
from phalanx.protocol.commands import CheckpointReq, EnqueueReq, ScaleReq
from phalanx.protocol.membership import HeartbeatReq, QuorumReq, RegisterReq
from phalanx.protocol.rl import (
    Completion,
    RolloutIn,
    SubmitReq,
    SyncDoneReq,
    parse_rollout_id,
)

MODULES = ["base", "membership", "quorum", "commands", "rl", "status"]
FREE_FORM = {
    ("EnqueueReq", "payload"),
    ("Command", "payload"),
}
"""Fields that carry free-form JSON on purpose (checked for depth and finite
numbers by ``check_plain_json``, not by a schema)."""


def wire_models() -> list[type[BaseModel]]:
    out = []
    for m in MODULES:
        mod = importlib.import_module(f"phalanx.protocol.{m}")
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, Wire) and obj.__module__ == mod.__name__:
                out.append(obj)
    return out


def unbounded(schema: dict[str, Any], defs: dict[str, Any], where: str) -> list[str]:
    """Every place in a JSON schema where an integer, a string, a list or an object
    has no bound."""
    if "$ref" in schema:
        return []  # checked as its own model
    out = []
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key, [])):
            out += unbounded(sub, defs, f"{where}|{i}")
    t = schema.get("type")
    fixed = "const" in schema or "enum" in schema
    if t == "integer" and ("minimum" not in schema or "maximum" not in schema) and not fixed:
        out.append(f"{where}: integer without minimum/maximum")
    if t == "string" and "maxLength" not in schema and not fixed:
        out.append(f"{where}: string without maxLength")
    if t == "array":
        if "maxItems" not in schema and "prefixItems" not in schema:
            out.append(f"{where}: array without maxItems")
        for i, sub in enumerate(schema.get("prefixItems", [])):
            out += unbounded(sub, defs, f"{where}[{i}]")
        if isinstance(schema.get("items"), dict):
            out += unbounded(schema["items"], defs, f"{where}[]")
    if t == "object" and "properties" not in schema:
        if "maxProperties" not in schema:
            out.append(f"{where}: object without maxProperties")
        keys = schema.get("propertyNames", {})
        if "maxLength" not in keys and "enum" not in keys and "pattern" not in keys:
            out.append(f"{where}: object keys without maxLength")
        if isinstance(schema.get("additionalProperties"), dict):
            out += unbounded(schema["additionalProperties"], defs, f"{where}{{}}")
    return out


@pytest.mark.parametrize("model", wire_models(), ids=lambda m: m.__name__)
def test_every_field_is_bounded(model: type[BaseModel]):
    schema = model.model_json_schema()
    problems = []
    for name, prop in schema.get("properties", {}).items():
        if (model.__name__, name) in FREE_FORM:
            continue
        problems += unbounded(prop, schema.get("$defs", {}), f"{model.__name__}.{name}")
    assert problems == []


@pytest.mark.parametrize("model", wire_models(), ids=lambda m: m.__name__)
def test_every_model_is_strict_and_closed(model: type[BaseModel]):
    assert model.model_config.get("strict") is True
    assert model.model_config.get("extra") == "forbid"
    assert model.model_config.get("allow_inf_nan") is False


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        # The audit's request: integers past any bound, journaled, broke /metrics.
        (CheckpointReq, {"replica_id": "a:1", "step": 10**30, "url": "u", "nbytes": 1}, "step"),
        (CheckpointReq, {"replica_id": "a:1", "step": 1, "url": "u", "nbytes": 10**400}, "nbytes"),
        (CheckpointReq, {"replica_id": "a:1", "step": -1, "url": "u", "nbytes": 1}, "step"),
        # Loose types: a boolean is not a count, a number is not a boolean.
        (ScaleReq, {"role": "rollout", "replicas": True}, "replicas"),
        (RegisterReq, {"role": "policy", "name": "a", "ranks": True}, "ranks"),
        (SyncDoneReq, {"replica_id": "a:1", "seq": 1, "version": 0, "ok": 1}, "ok"),
        (QuorumReq, {"replica_id": "a:1", "step": "3", "request_id": "r"}, "step"),
        (HeartbeatReq, {"replica_id": "a:1", "step": 1.0}, "step"),
        # Past the maximum, and unknown fields.
        (ScaleReq, {"role": "rollout", "replicas": 100_001}, "replicas"),
        (HeartbeatReq, {"replica_id": "a:1", "wait_s": 31}, "wait_s"),
        (HeartbeatReq, {"replica_id": "a:1", "stepp": 1}, "stepp"),
        (RegisterReq, {"role": "policy", "name": "x" * 65}, "name"),
        (EnqueueReq, {"target": "a", "kind": "drain", "payload": {"k": float("inf")}}, "payload"),
    ],
)
def test_out_of_bounds_or_loosely_typed_values_are_refused(model, body, field):
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(json.dumps(body, allow_nan=True))
    assert field in {str(err["loc"][0]) for err in e.value.errors()}


def test_extremes_within_bounds_are_accepted():
    CheckpointReq.model_validate_json(
        json.dumps({"replica_id": "a:1", "step": MAX_INT, "url": "u", "nbytes": MAX_INT})
    )
    CheckpointReq.model_validate_json(
        json.dumps({"replica_id": "a:1", "step": 0, "url": "u", "nbytes": 0})
    )
    ScaleReq.model_validate_json('{"role": "rollout", "replicas": 0}')
    ScaleReq.model_validate_json('{"role": "rollout", "replicas": 100000}')


def test_a_rollout_carries_its_payload_or_its_ref_never_both():
    c = Completion(prompt_ids=[1], token_ids=[2], logprobs=[-0.5], finished=True, reward=1.0)
    base = {"rollout_id": "p1.0", "version": 0, "reward": 1.0, "exact_match": 1.0}
    RolloutIn(**base, completions=[c])
    RolloutIn(**base, ref="p1.0-1-abc")
    for bad in ({"completions": [c], "ref": "x"}, {}):
        with pytest.raises(ValidationError, match="completions or the ref"):
            RolloutIn(**base, **bad)
    with pytest.raises(ValidationError):  # a log-prob above 0 is not a probability
        Completion(prompt_ids=[1], token_ids=[2], logprobs=[0.1], finished=True, reward=0)
    with pytest.raises(ValidationError):  # a submission holds at least one rollout
        SubmitReq(replica_id="r:1", lease_id="L1", rollouts=[])


@pytest.mark.parametrize("rid", ["p1", "p1.2.3", "1.0", "p-1.0", "p01.0", "p1.0 ", "p+1.0"])
def test_rollout_ids_are_canonical(rid):
    with pytest.raises(ValueError, match=r"p<prompt>\.<attempt>"):
        parse_rollout_id(rid)


def test_the_openapi_spec_is_generated_from_the_protocol(tmp_path):
    """Every route of the controller documents its request and reply with the
    protocol's models, and every error reply with ErrorBody."""
    from phalanx.config import JobConfig
    from phalanx.controller.http import ROUTES, create_app
    from phalanx.controller.journal import SqliteJournal as Journal
    from phalanx.controller.payloads import PayloadLog
    from phalanx.controller.service import ControllerService

    svc = ControllerService(
        JobConfig(), Journal(tmp_path / "j.sqlite"), PayloadLog(tmp_path / "payloads")
    )
    spec = create_app(svc, "t").openapi()
    schemas = spec["components"]["schemas"]
    for route in ROUTES:
        op = spec["paths"][route.path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body.endswith(f"/{route.request.__name__}"), route.path
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ok.endswith(f"/{route.reply.__name__}"), route.path
        assert "ErrorBody" in json.dumps(op["responses"]["422"])
        assert route.request.__name__ in schemas and route.reply.__name__ in schemas
    status = spec["paths"]["/v1/status"]["get"]["responses"]["200"]
    assert status["content"]["application/json"]["schema"]["$ref"].endswith("/Status")
