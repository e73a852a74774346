"""Supervision in the deployment files (issue 39): what `plugsearch-stack` does for local processes, compose and
Kubernetes do for containers. Every long-running compose service is restarted when it dies and has a
healthcheck; one-shot jobs are not restarted. Every Kubernetes Deployment restarts its containers (the pod's
`restartPolicy` Always, Kubernetes' default) and has liveness, readiness and startup probes, with liveness
on `/health/live` (the process alone: a dead upstream must make a service not ready, never restart it)."""

from __future__ import annotations

from typing import Any

from tests.unit.test_deploy_config import compose, compose_raw, containers, objects, rendered  # noqa: F401

ONE_SHOT = {"index"}
"""Compose services that run once and exit."""


def test_compose_restarts_every_long_running_service(compose: dict[str, Any]) -> None:  # noqa: F811
    services = compose["services"]
    assert ONE_SHOT <= services.keys()
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", name
            continue
        assert service.get("restart") in ("unless-stopped", "always"), name
        assert service.get("healthcheck", {}).get("test"), name


def test_kubernetes_restarts_every_deployment_on_its_liveness_alone(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:  # noqa: F811
    _, docs = rendered
    deployments = objects(docs, "Deployment")
    assert deployments
    for name, container, pod in containers(docs):
        if name not in deployments:
            continue
        assert pod.get("restartPolicy", "Always") == "Always", name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, (name, probe)
        liveness = container["livenessProbe"]
        path = liveness.get("httpGet", {}).get("path")
        if name.startswith("plugsearch-") or name in ("retriever", "generator", "judge", "searcher"):
            assert path == "/health/live", (name, liveness)
        assert liveness.get("failureThreshold", 3) >= 2, (name, liveness)  # one slow answer is not a death
