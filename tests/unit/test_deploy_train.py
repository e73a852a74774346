"""Static checks of training beyond one GPU (no Docker, GPU or cluster): the `k8s/overlays/train` overlay
(a KubeRay RayJob running veRL across nodes, a multi-GPU TRL Job through `accelerate launch`), the
accelerate configs, and the veRL image (`docker/verl.Dockerfile`).

- the RayJob validates against KubeRay's own RayJob CRD schema (vendored under tests/schemas/kuberay, the
  file of a tagged release, checked by its git blob id), strictly (an unknown field is an error, as with
  `kubectl apply --validate=strict`), plus the rules KubeRay's webhook checks in Go; its pod templates and
  every core object validate against Kubernetes' schemas (kubernetes-validate);
- the commands they run are real: the RayJob's entrypoint through our CLIs' parsers and veRL's config (its
  nnodes / GPUs per node are the worker group's, and the batch arithmetic holds for that many GPUs), the
  Job's through accelerate's own launch parser and config loader and plugsearch-train's parser;
- the pods reach the services by their in-cluster names with the internal token from the Secret, and use
  volumes the gpu and train overlays create.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugsearch.trainer.verl import CONFIG_DIR
from plugsearch.trainer.verl.check_config import VERL_VERSION, batch_problems
from tests.unit.test_deploy_config import (
    K8S_VERSION,
    REPO,
    console_scripts,
    entrypoint,
    env_names,
    env_prefix,
    k8s_env,
    kustomize,
    objects,
    parse_dockerfile,
    resolve_script,
    stage_env,
)

CRD = REPO / "tests" / "schemas" / "kuberay" / "ray.io_rayjobs.yaml"
CRD_BLOB = "c7d3f081af8cf08c256a8c33a0c3b6ea28b816a0"
"""git blob id of ray-operator/config/crd/bases/ray.io_rayjobs.yaml at KubeRay v1.7.0 (tests/schemas/README.md)."""
VERL_DOCKERFILE = REPO / "docker" / "verl.Dockerfile"
VERL_CONFIG_DIR = "/opt/plugsearch/plugsearch/trainer/verl"
ACCELERATE_DIR = "/opt/plugsearch/accelerate"
SERVICE_URLS = {"TRAINER_RETRIEVER__URL": "retriever", "TRAINER_GENERATOR__URL": "generator",
                "TRAINER_JUDGE__URL": "judge", "TRAINER_SEARCHER__URL": "searcher"}


@pytest.fixture(scope="module")
def train() -> list[dict[str, Any]]:
    return kustomize("train")


@pytest.fixture(scope="module")
def rayjob(train: list[dict[str, Any]]) -> dict[str, Any]:
    (job,) = objects(train, "RayJob").values()
    return job


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    with CRD.open(encoding="utf-8") as fh:
        data = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert isinstance(data, dict)
    return data


def extras() -> dict[str, list[str]]:
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def pinned(requirements: list[str], name: str) -> str:
    """The exact version `name==X` (or `name[extra]==X`) pins in a requirement list."""
    for req in requirements:
        match = re.fullmatch(rf"{re.escape(name)}(\[[\w,-]+\])?==([\w.]+)", req)
        if match:
            return match.group(2)
    raise AssertionError(f"{name} is not pinned in {requirements}")


# ------------------------------------------------------------------------------------- the CRD schema
def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused (the API server prunes them; strict field validation, as
    `kubectl apply --validate=strict`, rejects them), except where the schema keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def rayjob_validator(crd: dict[str, Any]) -> Any:
    import jsonschema

    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    schema = strict(version["schema"]["openAPIV3Schema"])

    def cel(validator: Any, rules: Any, instance: Any, schema: Any) -> Iterator[Any]:
        # CEL rules run in the API server only: a field carrying one must be looked at by hand
        yield jsonschema.ValidationError(f"field with CEL rules not checked offline: {[r['rule'] for r in rules]}")

    validator_class = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-validations": cel})
    return validator_class(schema)


def crd_errors(crd: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in rayjob_validator(crd).iter_errors(doc)]


def test_vendored_crd_is_kuberays_own_file(crd: dict[str, Any]) -> None:
    data = CRD.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == CRD_BLOB  # noqa: S324 - git's object id
    readme = (REPO / "tests" / "schemas" / "README.md").read_text()
    assert CRD_BLOB in readme and "v1.7.0" in readme and "ray-operator/config/crd/bases/ray.io_rayjobs.yaml" in readme
    assert crd["spec"]["group"] == "ray.io" and crd["spec"]["names"]["kind"] == "RayJob"


def test_rayjob_validates_against_the_rayjob_crd(crd: dict[str, Any], rayjob: dict[str, Any]) -> None:
    assert rayjob["apiVersion"] == "ray.io/v1"
    assert crd_errors(crd, rayjob) == []
    # the check can fail: a misspelt field, a wrong type, a field with CEL rules
    broken = yaml.safe_load(yaml.safe_dump(rayjob))
    broken["spec"]["entryPoint"] = broken["spec"].pop("entrypoint")
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "2"
    broken["spec"]["managedBy"] = "ray.io/kuberay-operator"
    errors = "\n".join(crd_errors(crd, broken))
    assert "entryPoint" in errors and "replicas" in errors and "CEL" in errors


def ray_pods(rayjob: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = rayjob["spec"]
    yield "head", spec["rayClusterSpec"]["headGroupSpec"]["template"]
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        yield group["groupName"], group["template"]
    yield "submitter", spec["submitterPodTemplate"]


def test_ray_pod_templates_and_core_objects_validate_against_kubernetes(train: list[dict[str, Any]],
                                                                        rayjob: dict[str, Any]) -> None:
    import kubernetes_validate

    for doc in train:
        if doc["apiVersion"] != "ray.io/v1":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for name, template in ray_pods(rayjob):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{rayjob['metadata']['name']}-{name}",
                                                                **template.get("metadata", {})},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert all(d["metadata"].get("namespace") == "plugsearch" for d in train)
    assert {d["kind"] for d in train} == {"RayJob", "Job", "PersistentVolumeClaim"}


def test_rayjob_passes_kuberays_webhook_rules(rayjob: dict[str, Any]) -> None:
    """Mirrors KubeRay v1.7.0's ValidateRayJobMetadata / ValidateRayJobSpec / ValidateRayClusterSpec
    (ray-operator/controllers/ray/utils/validation.go) for the fields this RayJob sets."""
    name = rayjob["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    spec = rayjob["spec"]
    assert not spec["suspend"] or spec["shutdownAfterJobFinishes"]  # a suspended RayJob must shut down after
    assert spec["ttlSecondsAfterFinished"] >= 0 and spec["backoffLimit"] >= 0
    assert spec["submissionMode"] == "K8sJobMode"  # the submitter pod template is refused in SidecarMode
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert not cluster.get("enableInTreeAutoscaling")
    for group in cluster["workerGroupSpecs"]:
        assert group["template"]["spec"]["containers"]
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert not ({"num-cpus", "num-gpus", "memory", "resources"} & set(group["rayStartParams"])
                    and group.get("resources"))
    # the submitter container gets KubeRay's `ray job submit` command only when it sets none
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    assert "command" not in submitter and "args" not in submitter


# ----------------------------------------------------------------------------------- what the pods run
def workers(rayjob: dict[str, Any]) -> dict[str, Any]:
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group  # type: ignore[no-any-return]


def entrypoint_commands(rayjob: dict[str, Any]) -> list[list[str]]:
    """The RayJob's entrypoint: `bash -c '<a> && <b> && exec <c>'` (KubeRay pastes it into its own bash
    command line, so the && must be inside one quoted argument)."""
    outer = shlex.split(rayjob["spec"]["entrypoint"])
    assert outer[:2] == ["bash", "-c"] and len(outer) == 3, outer
    commands = [shlex.split(part) for part in outer[2].split("&&")]
    return [c[1:] if c[0] == "exec" else c for c in commands]


def parses(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse accepts the options and choices of `argv` (it checks them before the trailing --help)."""
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    usage = capsys.readouterr().out
    assert exc.value.code == 0, usage
    for option in (a.split("=")[0] for a in argv if a.startswith("--")):
        assert option in usage, option
    return usage


def test_rayjob_entrypoint_matches_the_cluster_and_veRLs_arithmetic(rayjob: dict[str, Any],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from omegaconf import OmegaConf

    from plugsearch.trainer.verl import data

    baseline, parquet, verl = entrypoint_commands(rayjob)
    assert baseline[0] == "plugsearch-train" and baseline[1] == "baseline"
    parses(resolve_script(baseline[0]), baseline[1:], capsys)
    assert parquet[:3] == ["python3", "-m", "plugsearch.trainer.verl.data"]
    args = data._parser().parse_args(parquet[3:])
    assert args.s3_filter and args.datasets == baseline[baseline.index("--datasets") + 1:][:len(args.datasets)]

    assert verl[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    options = dict(a.split("=", 1) for a in verl[3:] if a.startswith("--"))
    assert options["--config-path"] == VERL_CONFIG_DIR
    assert (CONFIG_DIR / f"{options['--config-name']}.yaml").is_file()
    overrides = dict(a.split("=", 1) for a in verl[3:] if not a.startswith("--"))
    group = workers(rayjob)
    (worker,) = group["template"]["spec"]["containers"]
    gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
    assert int(overrides["trainer.nnodes"]) == group["replicas"] == group["minReplicas"] == group["maxReplicas"]
    assert int(overrides["trainer.n_gpus_per_node"]) == gpus == 8
    config = OmegaConf.load(CONFIG_DIR / f"{options['--config-name']}.yaml")
    assert batch_problems(config, nnodes=group["replicas"], gpus_per_node=gpus) == []
    # the parquet lands where the config reads it, the checkpoints on the shared volume
    env = k8s_env(rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    assert str(args.out) == env["PLUGSEARCH_VERL_DATA"]
    mounts = {m["mountPath"] for m in rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["volumeMounts"]}
    assert env["TRAINER_DATA_DIR"] in mounts and env["TRAINER_VAR_DIR"] in mounts  # questions, baselines
    assert env["CHECKPOINT_DIR"].startswith(env["TRAINER_VAR_DIR"] + "/")
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == pinned(extras()["verl"], "ray")


def oc_env_names() -> set[str]:
    """Environment variables the veRL config and agent loop registry read (`${oc.env:NAME,...}`)."""
    text = "".join(p.read_text() for p in CONFIG_DIR.glob("*.yaml"))
    return set(re.findall(r"\$\{oc\.env:(\w+)", text))


def pvcs(docs: list[dict[str, Any]]) -> set[str]:
    return set(objects(docs, "PersistentVolumeClaim"))


def pods(train: list[dict[str, Any]], rayjob: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield from ray_pods(rayjob)
    for name, job in objects(train, "Job").items():
        yield name, job["spec"]["template"]


def test_pods_reach_the_services_with_the_internal_token_and_use_existing_volumes(
        train: list[dict[str, Any]], rayjob: dict[str, Any]) -> None:
    from plugsearch.trainer.common.settings import TrainerSettings

    gpu = kustomize("gpu")
    services = objects(gpu, "Service")
    volumes = pvcs(gpu) | pvcs(train)
    allowed = env_names(TrainerSettings, env_prefix(TrainerSettings)) | oc_env_names() | {"HF_HOME", "HF_TOKEN"}
    for name, template in pods(train, rayjob):
        spec = template["spec"]
        context = spec.get("securityContext", {})
        for container in spec["containers"]:
            merged = {**context, **container.get("securityContext", {})}
            assert merged.get("runAsNonRoot") is True and merged.get("allowPrivilegeEscalation") is False, name
            resources = container["resources"]
            assert resources["requests"] and resources["limits"], name
            if "nvidia.com/gpu" in resources["limits"]:
                assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
                assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
            env = container.get("env", [])
            assert not {e["name"] for e in env} - allowed, (name, sorted({e["name"] for e in env} - allowed))
            for var in env:
                if re.search(r"(TOKEN|API_KEYS?|PASSWORD)$", var["name"]):
                    ref = var["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == "plugsearch-secrets", (name, var["name"])
                    if var["name"].startswith("TRAINER_"):
                        assert ref["key"] == "internal-token" and not ref.get("optional"), (name, var["name"])
            values = k8s_env(container)
            for key, service in SERVICE_URLS.items():
                if key in values:
                    port = services[service]["spec"]["ports"][0]["port"]
                    assert values[key] == f"http://{service}:{port}", (name, key)
                    assert f"{key[:-5]}__TOKEN" in values, (name, key)
            mounted = {m["name"] for m in container.get("volumeMounts", [])}
            declared = {v["name"]: v for v in spec.get("volumes", [])}
            assert mounted <= set(declared), name
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in volumes, (name, volume)
    # pods on several nodes share the veRL volume: it must be ReadWriteMany
    assert objects(train, "PersistentVolumeClaim")["plugsearch-verl"]["spec"]["accessModes"] == ["ReadWriteMany"]
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert head["rayStartParams"]["num-gpus"] == "0"


# ----------------------------------------------------------------------------------------- accelerate
def accelerate_job(train: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    (container,) = objects(train, "Job")["plugsearch-train-accelerate"]["spec"]["template"]["spec"]["containers"]
    return container, [*container["command"], *container.get("args", [])]


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_accelerate_configs_load_with_accelerates_own_loader(name: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    path = REPO / "plugsearch" / "trainer" / "llm" / "accelerate" / f"{name}.yaml"
    config = ClusterConfig.from_yaml_file(str(path))  # refuses unknown keys
    assert config.num_processes == 8 and config.num_machines == 1 and config.mixed_precision == "bf16"
    assert str(config.distributed_type) == {"ddp": "DistributedType.MULTI_GPU", "fsdp": "DistributedType.FSDP"}[name]
    options = {action.dest for action in launch_command_parser()._actions}
    assert not set(config.fsdp_config) - options  # every FSDP setting is one accelerate launch knows


def test_accelerate_job_runs_trainer_cli_on_every_gpu(train: list[dict[str, Any]],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    container, command = accelerate_job(train)
    assert command[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(command[2:])
    config_file = Path(args.config_file)
    assert str(config_file.parent) == ACCELERATE_DIR
    local = REPO / "plugsearch" / "trainer" / "llm" / "accelerate" / config_file.name
    args.config_file = str(local)  # the image's copy of this file (checked below)
    args, _, _ = _validate_launch_command(args)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert args.num_processes == gpus == container["resources"]["requests"]["nvidia.com/gpu"]
    assert args.module and args.training_script == "plugsearch.trainer.cli"
    train_args = list(args.training_script_args)
    assert train_args[train_args.index("--precision") + 1] == args.mixed_precision == "bf16"
    assert train_args[train_args.index("--device") + 1] == "cuda"
    assert train_args[train_args.index("--vllm") + 1] == "colocate"
    parses(resolve_script("plugsearch-train"), train_args, capsys)
    assert console_scripts()["plugsearch-train"] == "plugsearch.trainer.cli:main"
    # the trainer image ships the configs at that path
    (stage,) = [s for s in parse_dockerfile(REPO / "docker" / "Dockerfile")[1] if s.name == "trainer"]
    copies = [tuple(c.value) for c in stage.commands if c.cmd.upper() == "COPY" and not c.flags]
    assert ("plugsearch/trainer/llm/accelerate", ACCELERATE_DIR) in copies
    assert entrypoint(stage) == ["plugsearch-train"]


# ----------------------------------------------------------------------------------------- veRL image
def test_verl_image_pins_verl_and_its_rollout_engine_together() -> None:
    args, stages = parse_dockerfile(VERL_DOCKERFILE)
    (stage,) = stages
    assert stage.name == "trainer-verl" and stage.base == "${VLLM_IMAGE}"
    stage_args = {c.value[0].partition("=")[0]: c.value[0].partition("=")[2] for c in stage.commands
                  if c.cmd.upper() == "ARG"}
    verl_extra = extras()["verl"]
    assert stage_args["VERL_VERSION"] == VERL_VERSION == pinned(verl_extra, "verl")
    assert stage_args["VLLM_VERSION"] == pinned(verl_extra, "vllm")
    assert args["VLLM_IMAGE"] == f"vllm/vllm-openai:v{stage_args['VLLM_VERSION']}"
    assert "verl" not in " ".join(extras()["all"])  # never pulled into the CPU environment
    runs = " ".join(" ".join(c.value) for c in stage.commands if c.cmd.upper() == "RUN")
    assert 'install -c /tmp/keep.txt ".[verl]"' in runs  # the base image's torch and vLLM stay
    user = stage.last("USER")
    assert user is not None and user.value[0].split(":")[0] not in ("root", "0")
    env = stage_env(stage)
    assert env["PLUGSEARCH_VERL_DIR"] == VERL_CONFIG_DIR
    entry = entrypoint(stage)
    assert entry[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    assert f"--config-path={VERL_CONFIG_DIR}" in entry and "--config-name=s3_grpo" in entry
    workdir = stage.last("WORKDIR").value[0]
    copies = {tuple(c.value) for c in stage.commands if c.cmd.upper() == "COPY"}
    assert ("plugsearch", "./plugsearch") in copies and VERL_CONFIG_DIR == f"{workdir}/plugsearch/trainer/verl"
    ignore = (REPO / "docker" / "verl.Dockerfile.dockerignore").read_text().splitlines()
    for source in {src for c in copies for src in c[:-1]}:
        assert f"!{source}" in ignore or f"!{source}/**" in ignore, source
