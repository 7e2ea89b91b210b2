"""P and D as Kubernetes pods: the manifests ``bidir-kv serve --emit kubernetes`` prints
and the ``kubernetes`` launcher applies (bidir_kv/launch/kubernetes.py).

Each node is a Pod running the command :func:`bidir_kv.serve.command.build` makes, with

* its accelerators and EFA interfaces as resource requests and limits
  (``nvidia.com/gpu`` or ``aws.amazon.com/neuron``, ``vpc.amazonaws.com/efa``) and
  ``IPC_LOCK`` for the memory NIXL registers;
* ``VLLM_NIXL_SIDE_CHANNEL_HOST`` from the downward API (the pod's own IP: the address
  the peer dials), and the side-channel ports (one per TP rank from the base port) and
  the HTTP port declared on the container;
* a Service of the same name, so the router reaches P and D by name and the peer's
  side channel is reachable through it as well as by pod IP;
* a required pod anti-affinity on the pair's label: P and D never share a node, so every
  D->P read crosses the fabric.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bidir_kv.serve.command import ServeSpec, build

__all__ = ["KubeOptions", "manifests", "render"]

_ACCELERATOR = {"cuda": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuron"}
EFA_RESOURCE = "vpc.amazonaws.com/efa"


@dataclass(frozen=True)
class KubeOptions:
    """Where and how the pods run."""

    image: str = "vllm/vllm-openai:latest"
    namespace: str = "default"
    name: str = "bidir-kv"  # pods are <name>-prefill and <name>-decode
    accelerators: int | None = None  # per pod; None: the TP size
    efa: int = 16  # EFA interfaces per pod (p5en.48xlarge has 16)
    shm_gib: int = 64  # /dev/shm for the server's worker processes


def _pod(spec: ServeSpec, opts: KubeOptions) -> dict[str, Any]:
    cmd = build(spec)
    name = f"{opts.name}-{spec.role}"
    labels = {
        "app.kubernetes.io/name": "bidir-kv",
        "app.kubernetes.io/instance": opts.name,
        "bidir-kv/role": spec.role,
    }
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in cmd.env.items() if k != "VLLM_NIXL_SIDE_CHANNEL_HOST"
    ]
    env.append(
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
    )
    count = opts.accelerators if opts.accelerators is not None else spec.tp
    resources: dict[str, str] = {}
    if spec.device in _ACCELERATOR:
        resources[_ACCELERATOR[spec.device]] = str(count)
    if opts.efa > 0:
        resources[EFA_RESOURCE] = str(opts.efa)
    ports = [{"name": "http", "containerPort": spec.http_port, "protocol": "TCP"}]
    ports += [
        {"name": f"side-{r}", "containerPort": spec.side_channel_port + r, "protocol": "TCP"}
        for r in range(spec.tp)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {
                                "matchLabels": {"app.kubernetes.io/instance": opts.name}
                            },
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
            "containers": [
                {
                    "name": spec.role,
                    "image": opts.image,
                    "command": list(cmd.argv),
                    "env": env,
                    "ports": ports,
                    "resources": {"requests": resources, "limits": resources},
                    "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 10,
                        "failureThreshold": 180,
                    },
                    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": [
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{opts.shm_gib}Gi"}}
            ],
        },
    }


def _service(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod["metadata"]
    ports = pod["spec"]["containers"][0]["ports"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": meta["labels"],
        },
        "spec": {
            "selector": meta["labels"],
            "ports": [
                {
                    "name": p["name"],
                    "port": p["containerPort"],
                    "targetPort": p["containerPort"],
                    "protocol": "TCP",
                }
                for p in ports
            ],
        },
    }


def manifests(specs: Sequence[ServeSpec], opts: KubeOptions) -> list[dict[str, Any]]:
    """A Pod and a Service per node spec (P then D)."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        pod = _pod(spec, opts)
        out += [pod, _service(pod)]
    return out


def render(docs: Sequence[dict[str, Any]]) -> str:
    """A multi-document YAML stream (each document written as JSON, which YAML reads)."""
    return "".join(f"---\n{json.dumps(d, indent=2)}\n" for d in docs)
