"""The container images and Kubernetes manifests under deploy/: what can be checked
without a container runtime. Every manifest parses; the arguments each container passes
to `jvllm serve` parse with its own argument parser; probes, ports and scraping point at
routes the server has; the autoscaler's query names a metric the server exports."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from jvllm.cli import parse_serve_args
from jvllm.server.metrics import VLLM_NAMES

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def _manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def _instruction(dockerfile: str, name: str) -> list[str]:
    """The JSON (exec) form of a Dockerfile instruction."""
    (line,) = [x for x in dockerfile.splitlines() if x.startswith(name + " ")]
    return json.loads(line[len(name) + 1 :])


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_run_jvllm_serve_with_arguments_it_parses(name):
    text = (DEPLOY / name).read_text()
    assert _instruction(text, "ENTRYPOINT") == ["jvllm", "serve"]
    args = parse_serve_args(_instruction(text, "CMD"))
    assert args.model is None  # the demo model by default
    assert (args.host, args.port) == ("0.0.0.0", int(re.search(r"^EXPOSE (\d+)", text, re.M)[1]))
    assert f"127.0.0.1:{args.port}/health" in text  # the image's health check
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = re.search(r'pip install --no-cache-dir "\.\[([a-z,]+)\]"', text)[1].split(",")
    assert set(wanted) <= set(extras["optional-dependencies"])
    for source in re.findall(r"^COPY (.+) \./", text, re.M):
        for part in source.split():
            assert (REPO / part).exists(), part


def test_kubernetes_deployment_parses_and_probes_the_servers_routes():
    docs = _manifests()
    assert set(docs) == {"Deployment", "Service", "ServiceMonitor", "ScaledObject"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_serve_args(container["args"])
    (port,) = container["ports"]
    assert args.port == port["containerPort"] and args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    # SIGTERM drains for --shutdown-timeout seconds; Kubernetes must wait longer.
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.model.startswith(mounts["models"] + "/")
    service = docs["Service"]
    assert service["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    (trigger,) = docs["ScaledObject"]["spec"]["triggers"]
    metric = re.match(r"sum\(([\w:]+)\{model_name=\"([^\"]+)\"\}\)", trigger["metadata"]["query"])
    assert metric[1] in VLLM_NAMES.values() and [metric[2]] == args.served_model_name
    assert (
        docs["ScaledObject"]["spec"]["scaleTargetRef"]["name"]
        == docs["Deployment"]["metadata"]["name"]
    )
