"""The slurm and kubernetes launchers on bad input: one line naming the cause, nothing
left behind. The slurm launcher's cases against a real Slurm cluster are in
suites/integration/test_slurm.py. The Kubernetes API is a stand-in
(bidir_kv/testing/doubles/kube_api.py: no API server runs here offline) that answers as
the API server does and validates every object it is sent against Kubernetes' schemas."""

from __future__ import annotations

import copy

import pytest

from bidir_kv.launch.kubernetes import KubeApi, KubeLauncher
from bidir_kv.launch.process import free_port
from bidir_kv.launch.remote import LaunchFailed
from bidir_kv.launch.slurm import allocation
from bidir_kv.serve.command import recipe_pair
from bidir_kv.serve.kubernetes import KubeOptions, manifests
from bidir_kv.testing.doubles.kube_api import kube_api_stand_in


def test_slurm_outside_an_allocation_or_without_slurm() -> None:
    with pytest.raises(LaunchFailed, match=r"^slurm: not inside an allocation"):
        allocation({})


def test_kubernetes_pods_are_created_valid_and_deleted() -> None:
    """Every object the launcher sends passes Kubernetes' schemas (the stand-in refuses
    any other), and stopping the node deletes what it created."""
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    with kube_api_stand_in(token="t") as api:
        pod = KubeLauncher(KubeApi(api.url, token="t")).start(
            manifests([p], KubeOptions(name="rel"))
        )
        assert sorted(api.objects) == [
            ("default", "pods", "rel-prefill"),
            ("default", "services", "rel-prefill"),
        ]
        assert pod.stop() == "pod default/rel-prefill: deleted"
        assert api.objects == {}


def test_kubernetes_api_error_fails_in_one_line_and_deletes_what_it_created() -> None:
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    docs = manifests([p], KubeOptions(name="rel"))
    with kube_api_stand_in(token="t", refuse={"services": 403}) as api:
        with pytest.raises(LaunchFailed) as failure:
            KubeLauncher(KubeApi(api.url, token="t")).start(docs)
        text = str(failure.value)
        assert "\n" not in text
        assert text.startswith(
            f"kubernetes API {api.url}: creating service rel-prefill: 403 Forbidden: "
        ), text
        assert api.calls == [
            ("POST", "/api/v1/namespaces/default/pods"),
            ("POST", "/api/v1/namespaces/default/services"),
            ("DELETE", "/api/v1/namespaces/default/pods/rel-prefill"),
        ]
        assert api.objects == {}


def test_an_object_kubernetes_schemas_refuse_fails_in_one_line_naming_the_field() -> None:
    """A manifest the API server would refuse (here a port given as text and a field no
    schema has) is refused by the stand-in too, 422 Invalid naming the field; the launch
    fails in one line and leaves nothing."""
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    docs = manifests([p], KubeOptions(name="rel"))
    bad = copy.deepcopy(docs)
    pod = next(d for d in bad if d["kind"] == "Pod")
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with kube_api_stand_in() as api:
        with pytest.raises(LaunchFailed) as failure:
            KubeLauncher(KubeApi(api.url)).start(bad)
        text = str(failure.value)
        assert "\n" not in text
        assert text.startswith(
            f"kubernetes API {api.url}: creating pod rel-prefill: 422 Invalid: "
            'Pod "rel-prefill" is invalid: spec.containers.0.ports.0.containerPort: '
        ), text
        unknown = copy.deepcopy(docs)
        next(d for d in unknown if d["kind"] == "Service")["spec"]["portz"] = []
        with pytest.raises(LaunchFailed, match=r"422 Invalid: Service \"rel-prefill\" is invalid"):
            KubeLauncher(KubeApi(api.url)).start(unknown)
        assert api.objects == {}


def test_kubernetes_api_unreachable_fails_in_one_line() -> None:
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    port = free_port()  # nothing listens there
    with pytest.raises(LaunchFailed) as failure:
        KubeLauncher(KubeApi(f"http://127.0.0.1:{port}")).start(manifests([p], KubeOptions()))
    text = str(failure.value)
    assert "\n" not in text and text.startswith(
        f"kubernetes API http://127.0.0.1:{port}: creating pod bidir-kv-prefill: ConnectError"
    )
