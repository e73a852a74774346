"""Tracing in the deployment files, read for real: the compose file (its `tracing` profile and the OTEL_*
variables of every service), the Kubernetes overlays rendered by `kubectl kustomize` (the ConfigMap every
service reads, off; on with k8s/components/tracing), and the images' locks (the SDK and its exporter in
every image that runs a service or the trainer). Off unless the operator says so, everywhere."""

from __future__ import annotations

import runpy
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from plugsearch.common.tracing import requested_exporters
from tests.unit.test_deploy_config import (
    OVERLAYS,
    SECRET_PLACEHOLDER,
    SERVICES,
    console_scripts,
    healthcheck_target,
    interpolate,
    objects,
    resolve_script,
)

REPO = Path(__file__).resolve().parents[2]
TRACED_IMAGES = {"core", "generator", "retriever", "train"}
SECRETS = {"PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER, "PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER}


def compose(env: dict[str, str]) -> dict[str, Any]:
    return interpolate(yaml.safe_load((REPO / "docker-compose.yml").read_text()), {**SECRETS, **env})  # type: ignore[no-any-return]


def otel(environment: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in environment.items() if k.startswith("OTEL_")}


def test_compose_traces_nothing_unless_told() -> None:
    services = compose({})["services"]
    for name in SERVICES:
        assert requested_exporters(otel(services[name]["environment"])) == [], name


def test_compose_tracing_profile_collects_every_services_spans() -> None:
    endpoint = "http://otel-collector:4318"
    services = compose({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})["services"]
    for name in SERVICES:
        env = otel(services[name]["environment"])
        assert requested_exporters(env) == ["otlp"], name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on"  # a caller's decision is kept
        assert "otel-collector" not in services[name].get("depends_on", {})  # tracing never holds a service back
    collector = services[urlsplit(endpoint).hostname or ""]
    assert collector["profiles"] == ["tracing"] and "ports" not in collector  # internal network only
    (script,) = collector["entrypoint"]
    assert console_scripts()[script] == "plugsearch.collector:main" and callable(resolve_script(script))
    from plugsearch.collector import CollectorSettings, create_app

    settings = CollectorSettings(**{k.removeprefix("COLLECTOR_").lower(): v
                                    for k, v in collector["environment"].items()})
    assert settings.host == "0.0.0.0" and settings.port == urlsplit(endpoint).port
    path, port = healthcheck_target([str(x) for x in collector["healthcheck"]["test"]],
                                    {k: str(v) for k, v in collector["environment"].items()})
    assert port == settings.port
    assert path in {getattr(r, "path", None) for r in create_app(settings).routes}
    assert collector["build"]["target"] == "searcher"  # the core image: it has the OTLP decoder (the otel extra)


def test_every_image_that_runs_a_service_carries_the_sdk_and_exporter() -> None:
    images: dict[str, list[str]] = runpy.run_path(str(REPO / "scripts" / "lock_subsets.py"))["IMAGES"]
    assert {name for name, extras in images.items() if "otel" in extras} == TRACED_IMAGES
    for image in TRACED_IMAGES:
        text = (REPO / "requirements" / f"image-{image}.txt").read_text()
        for package in ("opentelemetry-sdk==", "opentelemetry-exporter-otlp-proto-http==", "opentelemetry-proto=="):
            assert f"\n{package}" in text, (image, package)
    for framework in ("langchain-core==", "llama-index-core==", "haystack-ai==", "dspy==", "litellm=="):
        for image in images:  # the frameworks are for users' apps, never in an image
            assert f"\n{framework}" not in (REPO / "requirements" / f"image-{image}.txt").read_text(), (image, framework)


def kustomize(path: Path) -> list[dict[str, Any]]:
    exe = shutil.which("kubectl")
    assert exe is not None, "kubectl is not installed"
    result = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def traced_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    deployments = objects(docs, "Deployment")
    return {name: deployments[name]["spec"]["template"]["spec"]["containers"][0] for name in SERVICES}


def config_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What a container gets from its ConfigMaps (envFrom)."""
    maps = objects(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_services_read_the_tracing_variables_and_trace_nothing_by_default(overlay: str) -> None:
    docs = kustomize(REPO / "k8s" / "overlays" / overlay)
    for name, container in traced_containers(docs).items():
        env = config_env(docs, container)
        assert requested_exporters(env) == [], (overlay, name)
        assert urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"]).port == 4318  # OTLP/HTTP, what the images export
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        assert not {e["name"] for e in container["env"]} & set(env)  # nothing overrides them


def test_the_tracing_component_switches_every_service_on(tmp_path: Path) -> None:
    """An overlay with `components: [../../components/tracing]` (kustomize reads only relative paths: a copy
    of k8s/ with one more overlay), rendered and checked against the Kubernetes schemas."""
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "traced"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../cpu"], "components": ["../../components/tracing"]}))
    docs = kustomize(overlay)
    for name, container in traced_containers(docs).items():
        assert requested_exporters(config_env(docs, container)) == ["otlp"], name
    validate = shutil.which("kubernetes-validate")
    assert validate is not None, "kubernetes-validate is not installed (the test extra installs it)"
    result = subprocess.run([validate, "--strict", "-k", "1.30.0", "-"], input=yaml.safe_dump_all(docs),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
