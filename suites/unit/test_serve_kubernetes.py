"""``bidir-kv serve --emit kubernetes``: P and D pods on two nodes with GPUs, EFA and a
reachable side channel, valid against Kubernetes' own schemas (offline)."""

from __future__ import annotations

import json

import pytest

from bidir_kv.serve.cli import main
from bidir_kv.serve.command import recipe_pair
from bidir_kv.serve.kubernetes import KubeOptions, manifests

kubernetes_validate = pytest.importorskip("kubernetes_validate")


def _docs(text: str) -> list[dict]:
    return [json.loads(d) for d in text.split("---\n") if d.strip()]


def test_emit_prints_a_pod_and_a_service_per_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--emit",
                "kubernetes",
                "--model",
                "Qwen/Qwen3-32B",
                "--nixl-backend",
                "LIBFABRIC",
                "--tp",
                "8",
                "--cold-prefill",
                "--image",
                "img:1",
            ]
        )
        == 0
    )
    docs = _docs(capsys.readouterr().out)
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Pod", "bidir-kv-prefill"),
        ("Service", "bidir-kv-prefill"),
        ("Pod", "bidir-kv-decode"),
        ("Service", "bidir-kv-decode"),
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    p, d = docs[0], docs[2]
    c = p["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "16"}
    assert c["command"][:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    assert "--no-enable-prefix-caching" in c["command"]
    assert "--no-enable-prefix-caching" not in d["spec"]["containers"][0]["command"]
    env = {e["name"]: e for e in c["env"]}
    assert (
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    )
    assert env["FI_PROVIDER"]["value"] == "efa"
    side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    assert {pt["containerPort"] for pt in c["ports"]} == {8100, *range(side, side + 8)}
    assert {pt["port"] for pt in docs[1]["spec"]["ports"]} == {8100, *range(side, side + 8)}
    anti = p["spec"]["affinity"]["podAntiAffinity"]
    assert (
        anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
        == "kubernetes.io/hostname"
    )


def test_a_broken_manifest_fails_the_schema() -> None:
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    (pod, _svc) = manifests([p], KubeOptions())
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.30", strict=True)


def test_role_is_still_required_without_emit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "m", "--dry-run"])
    assert "--role is required" in capsys.readouterr().err


def _allowlists(text: str) -> dict[str, object]:
    """Each pod's bidir_kv_peer_allowlist (None: unset), by role."""
    out: dict[str, object] = {}
    for doc in _docs(text):
        if doc["kind"] != "Pod":
            continue
        argv = doc["spec"]["containers"][0]["command"]
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        out[doc["metadata"]["labels"]["bidir-kv/role"]] = kv["kv_connector_extra_config"].get(
            "bidir_kv_peer_allowlist"
        )
    return out


@pytest.mark.parametrize(
    "args,expected",
    [
        # pod IPs are unknown until the pods run, and the router names them by Service:
        # each pod lists the other's engine id
        ((), {"prefill": ["decode-engine-001"], "decode": ["prefill-engine-001"]}),
        (
            ("--peer-allowlist", "10.244.0.0/16,decode-engine-001"),
            {
                "prefill": ["10.244.0.0/16", "decode-engine-001"],
                "decode": ["10.244.0.0/16", "decode-engine-001"],
            },
        ),
        (("--no-peer-allowlist",), {"prefill": None, "decode": None}),
    ],
)
def test_pods_list_their_peer(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], expected: dict[str, object]
) -> None:
    assert main(["--emit", "kubernetes", "--model", "m", "--peer-ip", "10.0.0.9", *args]) == 0
    assert _allowlists(capsys.readouterr().out) == expected


def test_pods_refuse_a_clashing_list(capsys: pytest.CaptureFixture[str]) -> None:
    own = json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"bidir_kv_peer_allowlist": ["x"]},
        }
    )
    assert (
        main(
            [
                "--emit",
                "kubernetes",
                "--model",
                "m",
                "--peer-allowlist",
                "y",
                "--",
                "--kv-transfer-config",
                own,
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert captured.out == "" and "clashes" in captured.err


def test_one_engine_id_for_both_pods_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--emit", "kubernetes", "--model", "m", "--engine-id", "eng-7"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--engine-id 'eng-7'" in captured.err and "two pods" in captured.err


def test_our_connector_in_pods_names_the_image(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["--emit", "kubernetes", "--model", "m", "--connector", "bidir-kv", "--image", "img:2"]
        )
        == 0
    )
    captured = capsys.readouterr()
    for doc in _docs(captured.out):
        if doc["kind"] == "Pod":
            argv = doc["spec"]["containers"][0]["command"]
            kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            assert kv["kv_connector_module_path"] == "bidir_kv.connector"
    assert "the image (img:2) must contain bidir-kv" in captured.err
