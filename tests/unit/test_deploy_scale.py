"""Static checks of `k8s/overlays/scale` (no cluster): the retriever's dense search on a Milvus cluster run by
the Milvus operator.

- the `Milvus` object validates, strictly (an unknown field is an error), against the operator's own CRD
  schema (vendored under tests/schemas/milvus-operator, the file of a tagged release, checked by its git blob
  id); every other object against Kubernetes' schemas (kubernetes-validate);
- the retriever and the index Job read only env vars the retriever's settings class has, build valid
  settings (dense on Milvus, the token from the Secret), and agree on the collection; the URI is the Service
  the operator creates for that `Milvus` (`<name>-milvus`, port 19530).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tests.unit.test_deploy_config import (
    K8S_VERSION,
    REPO,
    SECRET_PLACEHOLDER,
    env_names,
    env_prefix,
    k8s_env,
    kustomize,
    load_settings,
    objects,
    settings_class,
)
from tests.unit.test_deploy_train import strict

CRD = REPO / "tests" / "schemas" / "milvus-operator" / "milvus.io_milvuses.yaml"
CRD_BLOB = "5c2cd7985cadbb4bff652375fe5cc0d21f585b5d"
"""git blob id of config/crd/bases/milvus.io_milvuses.yaml at milvus-operator v1.3.8 (tests/schemas/README.md)."""
MILVUS_PORT = 19530


@pytest.fixture(scope="module")
def scale() -> list[dict[str, Any]]:
    return kustomize("scale")


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    with CRD.open(encoding="utf-8") as fh:
        data = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert isinstance(data, dict)
    return data


def crd_errors(crd: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    import jsonschema

    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1beta1"]
    assert version["served"] and version["storage"]

    def cel(validator: Any, rules: Any, instance: Any, schema: Any) -> Iterator[Any]:
        yield jsonschema.ValidationError(f"field with CEL rules not checked offline: {[r['rule'] for r in rules]}")

    cls = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-validations": cel})
    validator = cls(strict(version["schema"]["openAPIV3Schema"]))
    return [f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_vendored_crd_is_the_operators_own_file(crd: dict[str, Any]) -> None:
    data = CRD.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == CRD_BLOB  # noqa: S324 - git's object id
    readme = (REPO / "tests" / "schemas" / "README.md").read_text()
    assert CRD_BLOB in readme and "v1.3.8" in readme and "config/crd/bases/milvus.io_milvuses.yaml" in readme
    assert crd["spec"]["group"] == "milvus.io" and crd["spec"]["names"]["kind"] == "Milvus"


def test_milvus_validates_against_the_operators_crd(crd: dict[str, Any], scale: list[dict[str, Any]]) -> None:
    (milvus,) = objects(scale, "Milvus").values()
    assert milvus["apiVersion"] == "milvus.io/v1beta1" and milvus["spec"]["mode"] == "cluster"
    assert crd_errors(crd, milvus) == []
    broken = yaml.safe_load(yaml.safe_dump(milvus))  # the check can fail: a misspelt field, a wrong type
    broken["spec"]["components"]["queryNode"]["replica"] = broken["spec"]["components"]["queryNode"].pop("replicas")
    broken["spec"]["dependencies"]["msgStreamType"] = "redis"
    broken["spec"]["mode"] = 3
    errors = "\n".join(crd_errors(crd, broken))
    assert "replica" in errors and "msgStreamType" in errors and "mode" in errors


def test_other_objects_validate_against_kubernetes_schemas(scale: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    checked = 0
    for doc in scale:
        if doc["apiVersion"] in ("monitoring.coreos.com/v1", "milvus.io/v1beta1"):  # CRDs: checked apart
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 20
    assert all(d["metadata"].get("namespace") == "plugsearch" for d in scale if d["kind"] != "Namespace")


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def test_retriever_and_index_job_point_at_the_operators_service(scale: list[dict[str, Any]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (milvus,) = objects(scale, "Milvus").values()
    cls = settings_class("retriever")
    found = {}
    for kind, name in (("Deployment", "retriever"), ("Job", "plugsearch-index")):
        container = _container(objects(scale, kind)[name])
        env = k8s_env(container)
        unknown = set(env) - env_names(cls, env_prefix(cls))
        assert not unknown, f"{name}: env vars no settings field reads: {sorted(unknown)}"
        token = [e for e in container["env"] if e["name"] == "RETRIEVER_MILVUS__TOKEN"]
        assert token and token[0]["valueFrom"]["secretKeyRef"] == {"name": "plugsearch-secrets", "key": "milvus-token"}
        settings = load_settings("retriever", env, monkeypatch)
        assert settings.dense and settings.dense_backend == "milvus" and not settings.milvus.is_local
        assert settings.milvus.token is not None and settings.milvus.token.get_secret_value() == SECRET_PLACEHOLDER
        uri = urlparse(settings.milvus.uri)
        assert (uri.hostname, uri.port) == (f"{milvus['metadata']['name']}-milvus", MILVUS_PORT)
        found[name] = settings
    served, built = found["retriever"], found["plugsearch-index"]
    # the Job builds what the retriever serves: same corpus, index folder, collection and index type
    for field in ("corpus", "index_dir", "bm25_backend"):
        assert getattr(served, field) == getattr(built, field), field
    assert served.milvus.model_dump(include={"uri", "collection", "index_type", "db_name"}) == \
        built.milvus.model_dump(include={"uri", "collection", "index_type", "db_name"})
    assert served.default_method == "hybrid" and served.methods() == ["bm25", "dense", "hybrid"]
    assert _container(objects(scale, "Job")["plugsearch-index"])["command"] == ["plugsearch-index"]
    # authentication is on in the cluster, so the token the pods present is needed
    assert milvus["spec"]["config"]["common"]["security"]["authorizationEnabled"] is True
