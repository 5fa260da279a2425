"""The Helm chart with standby controllers: etcd and the controllers as StatefulSets,
the journal URL every controller is given, and every controller's URL given to each
replica (rendered with `helm template` and checked offline, as test_helm_chart.py)."""

from __future__ import annotations

import pytest
from test_helm_chart import (
    HELM,
    KUBERNETES,
    argv,
    build_parser,
    container,
    env_of,
    helm,
    load_config,
    render,
    replica_pods,
)

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed")

HA = ("etcd.enabled=true", "controller.replicas=3")
ETCD = ",".join(f"job-phalanx-etcd-{i}.job-phalanx-etcd.ml.svc:2379" for i in range(3))
PEERS = "job-phalanx-controller-peers.ml.svc"


def test_every_object_is_valid_for_kubernetes():
    import kubernetes_validate

    for obj in render("ft_hsdp.toml", *HA).values():
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_the_chart_s_etcd_is_a_stateful_set_whose_members_name_each_other():
    objs = render("ft_hsdp.toml", *HA)
    sts = objs["StatefulSet", "job-phalanx-etcd"]
    svc = objs["Service", "job-phalanx-etcd"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "job-phalanx-etcd"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # the cluster forms together
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    c = container(sts)
    flags = dict(a.split("=", 1) for a in c["args"])
    # Each member's peer URL is its pod's name under the headless Service.
    pod = "job-phalanx-etcd-1"
    peer = flags["--initial-advertise-peer-urls"].replace("$(POD_NAME)", pod)
    cluster = dict(m.split("=", 1) for m in flags["--initial-cluster"].split(","))
    assert list(cluster) == [f"job-phalanx-etcd-{i}" for i in range(3)]
    assert cluster[pod] == peer == f"http://{pod}.job-phalanx-etcd.ml.svc:2380"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"


def test_standby_controllers_are_a_stateful_set_on_the_etcd_journal(tmp_path):
    objs = render("ft_hsdp.toml", *HA)
    assert ("Deployment", "job-phalanx-controller") not in objs
    assert not [n for (k, n) in objs if k == "PersistentVolumeClaim"]  # the job is in etcd
    sts = objs["StatefulSet", "job-phalanx-controller"]
    assert (
        sts["spec"]["replicas"] == 3
        and sts["spec"]["serviceName"] == "job-phalanx-controller-peers"
    )
    peers = objs["Service", "job-phalanx-controller-peers"]
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    c = container(sts)
    args, overrides = build_parser().parse_known_args(argv(c)[1:])
    assert args.command == "controller" and overrides == [f"--controller.journal=etcd://{ETCD}"]
    toml = tmp_path / "job.toml"
    toml.write_text(objs["ConfigMap", "job-phalanx-config"]["data"]["job.toml"])
    assert load_config(toml, overrides).controller.journal == f"etcd://{ETCD}"
    # Each controller advertises its own pod's name; the replicas get every one.
    assert env_of(c)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert args.advertise_host == f"$(POD_NAME).{PEERS}"
    urls = [f"http://job-phalanx-controller-{i}.{PEERS}:8470" for i in range(3)]
    for pod in replica_pods(objs).values():
        rc = container(pod)
        assert env_of(rc)["PHALANX_CONTROLLER"] == ",".join(urls)
        assert f"--controller.journal=etcd://{ETCD}" in rc["args"]  # one config for all
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}


def test_an_etcd_of_your_own_is_named_by_url_and_the_chart_runs_none():
    objs = render("ft_hsdp.toml", "etcd.url=etcd://etcd.infra:2379/jobs", "controller.replicas=2")
    assert not [n for (k, n) in objs if "etcd" in n]
    c = container(objs["StatefulSet", "job-phalanx-controller"])
    assert "--controller.journal=etcd://etcd.infra:2379/jobs" in c["args"]


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (
            ("controller.replicas=3",),
            "controller.replicas must be 1 without an etcd journal: got 3",
        ),
        (
            ("etcd.enabled=true", "etcd.url=etcd://e:2379"),
            "etcd.url must be empty when etcd.enabled is true",
        ),
    ],
)
def test_standbys_without_a_journal_to_share_fail_in_one_line(sets, says):
    r = helm("ft_hsdp.toml", *sets)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.startswith("Error: execution error") and says in r.stderr.splitlines()[0]


def test_an_etcd_url_that_is_not_one_fails_at_the_schema():
    r = helm("ft_hsdp.toml", "etcd.url=http://e:2379")
    assert r.returncode != 0 and "etcd.url: Does not match pattern" in r.stderr
