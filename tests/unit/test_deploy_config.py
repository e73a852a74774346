"""Static checks of the deployment files against the code (no Docker daemon or cluster needed).

Everything here reads the real sources: docker-compose.yml, docker/*Dockerfile, the kustomize overlays
rendered by `kubectl kustomize`, pyproject's console scripts, the services' settings classes and apps.
Any drift (entrypoint, port, env var name or value type, healthcheck/probe path) fails a test.
"""

from __future__ import annotations

import importlib
import os
import re
import runpy
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic_settings import BaseSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
VLLM_DOCKERFILE = REPO / "docker" / "vllm.Dockerfile"
OVERLAYS = ("cpu", "gpu")
SERVICES = ("retriever", "generator", "judge", "searcher")
LOCK_IMAGES: dict[str, list[str]] = runpy.run_path(str(REPO / "scripts" / "lock_subsets.py"))["IMAGES"]
"""image lock (requirements/image-<name>.txt) -> the extras it holds"""
K8S_VERSION = "1.30.0"
SECRET_PLACEHOLDER = "placeholder-secret-value-0123456789"


# ------------------------------------------------------------------------------------ code side
def settings_class(service: str) -> type[BaseSettings]:
    module = importlib.import_module(f"plugsearch.{service}.settings")
    cls = getattr(module, f"{service.capitalize()}Settings")
    assert issubclass(cls, BaseSettings)
    return cls  # type: ignore[no-any-return]


def env_prefix(cls: type[BaseSettings]) -> str:
    return str(cls.model_config.get("env_prefix", ""))


def env_names(cls: type[BaseModel], prefix: str) -> set[str]:
    """Every env var a settings class reads: PREFIX + FIELD, nested models as PREFIX + FIELD + __ + SUB."""
    names: set[str] = set()
    for name, info in cls.model_fields.items():
        key = f"{prefix}{name.upper()}"
        names.add(key)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= env_names(annotation, f"{key}__")
    return names


def load_settings(service: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Build the service's settings from exactly this env (nothing inherited with its prefix)."""
    cls = settings_class(service)
    prefix = env_prefix(cls)
    for key in list(os.environ):
        if key.startswith(prefix):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return cls()


def console_scripts() -> dict[str, str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return dict(data["project"]["scripts"])


def resolve_script(name: str) -> Any:
    target = console_scripts()[name]
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def app_paths(service: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Routes of the service's real app (created, lifespan not run: nothing is loaded)."""
    settings = load_settings(service, {}, monkeypatch)
    api = importlib.import_module(f"plugsearch.{service}.api")
    app = api.create_app(settings)
    return {getattr(route, "path", "") for route in app.routes}


# ------------------------------------------------------------------------------ Dockerfile side
@dataclass
class Stage:
    name: str
    base: str
    commands: list[Any]
    """`dockerfile.Command`s (cmd, value, flags, json) from BuildKit's own parser."""

    @property
    def instructions(self) -> list[tuple[str, str]]:
        return [(c.cmd.upper(), " ".join([*c.flags, *c.value])) for c in self.commands]

    def last(self, keyword: str) -> Any | None:
        found = [c for c in self.commands if c.cmd.upper() == keyword]
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages), parsed by the `dockerfile` package (Docker's Go parser)."""
    import dockerfile as parser

    args: dict[str, str] = {}
    stages: list[Stage] = []
    for command in parser.parse_file(str(path)):
        keyword = command.cmd.upper()
        if keyword == "FROM":
            value = list(command.value)
            name = value[2] if len(value) >= 3 and value[1].upper() == "AS" else f"stage{len(stages)}"
            stages.append(Stage(name=name, base=value[0], commands=[]))
        elif not stages and keyword == "ARG":
            key, _, default = command.value[0].partition("=")
            args[key] = default
        elif stages:
            stages[-1].commands.append(command)
    return args, stages


def entrypoint(stage: Stage) -> list[str]:
    command = stage.last("ENTRYPOINT")
    assert command is not None, f"stage {stage.name} has no ENTRYPOINT"
    assert command.json, f"{stage.name}: ENTRYPOINT must use the exec form (signals reach the service)"
    return list(command.value)


def healthcheck_cmd(stage: Stage) -> list[str]:
    command = stage.last("HEALTHCHECK")
    assert command is not None, f"stage {stage.name} has no HEALTHCHECK"
    assert command.value[0] == "CMD" and command.json, command
    return list(command.value[1:])


def stage_env(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for command in stage.commands:
        if command.cmd.upper() == "ENV":
            env.update(zip(command.value[::2], command.value[1::2], strict=True))
    return env


def healthcheck_target(cmd: list[str], env: dict[str, str]) -> tuple[str, int]:
    """(path, port) that docker/healthcheck.py probes for this command line."""
    script = cmd.index("/usr/local/bin/plugsearch-healthcheck")
    args = cmd[script + 1:]
    assert len(args) in (2, 3), cmd
    path, default = args[0], int(args[-1])
    port = int(env.get(args[1], default)) if len(args) == 3 else default
    return path, port


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    args, stages = parse_dockerfile(DOCKERFILE)
    return args, {stage.name: stage for stage in stages}


# ----------------------------------------------------------------------------------- compose side
def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default} (unset only), ${VAR:?error}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in env and (env[name] != "" or op == "-"):
            return env[name]
        if op == ":?":
            raise KeyError(f"required variable {name} is unset: {arg}")
        return arg or ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?|-)([^}]*))?\}", sub, value)


@pytest.fixture(scope="module")
def compose_raw() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose(compose_raw: dict[str, Any]) -> dict[str, Any]:
    env = {"PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER, "PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER}
    return interpolate(compose_raw, env)  # type: ignore[no-any-return]


def test_compose_validates_against_the_compose_spec() -> None:
    exe = shutil.which("check-jsonschema")
    assert exe is not None, "check-jsonschema is not installed (the test extra installs it)"
    result = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_requires_the_secrets(compose_raw: dict[str, Any]) -> None:
    with pytest.raises(KeyError, match="PLUGSEARCH_INTERNAL_TOKEN"):
        interpolate(compose_raw, {"PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER})
    with pytest.raises(KeyError, match="PLUGSEARCH_API_KEYS"):
        interpolate(compose_raw, {"PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER})


def test_only_the_searcher_publishes_a_port(compose: dict[str, Any]) -> None:
    published = {name for name, svc in compose["services"].items()
                 if svc.get("ports") and "monitoring" not in svc.get("profiles", [])}
    assert published == {"searcher"}


@pytest.mark.parametrize("service", SERVICES)
def test_compose_service_matches_code(service: str, compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                      dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    svc = compose["services"][service]
    env = {k: str(v) for k, v in svc["environment"].items()}
    cls = settings_class(service)
    unknown = {k for k in env if not k.startswith("OTEL_")} - env_names(cls, env_prefix(cls))  # OTEL_*: tracing's
    assert not unknown, f"{service}: env vars no settings field reads: {sorted(unknown)}"
    settings = load_settings(service, env, monkeypatch)
    assert settings.host == "0.0.0.0"

    # the image: built from the Dockerfile target of the same name, whose entrypoint is the console script
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    target = svc["build"]["target"]
    assert target == service
    stage = dockerfile[1][target]
    assert entrypoint(stage) == [f"plugsearch-{service}"]
    assert console_scripts()[f"plugsearch-{service}"] == f"plugsearch.{service}.__main__:main"
    assert callable(resolve_script(f"plugsearch-{service}"))
    assert "entrypoint" not in svc and "command" not in svc

    # healthcheck: the settings' port and a route the app serves
    path, port = healthcheck_target([str(x) for x in svc["healthcheck"]["test"]], env)
    assert port == settings.port
    assert path in app_paths(service, monkeypatch)
    assert path == "/health/ready"
    # what the image exposes and its own healthcheck agree with compose
    assert stage_env(stage)[f"{service.upper()}_PORT"] == str(settings.port)
    assert stage_env(stage)[f"{service.upper()}_HOST"] == "0.0.0.0"
    assert list(stage.last("EXPOSE").value) == [str(settings.port)]
    assert healthcheck_target(healthcheck_cmd(stage), stage_env(stage)) == (path, port)


def test_compose_wiring_between_services(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose["services"]
    ports = {name: load_settings(name, {k: str(v) for k, v in services[name]["environment"].items()},
                                 monkeypatch).port for name in SERVICES}
    searcher = load_settings("searcher", {k: str(v) for k, v in services["searcher"]["environment"].items()},
                             monkeypatch)
    assert searcher.retriever.url == f"http://retriever:{ports['retriever']}"
    assert searcher.retriever.token is not None and searcher.api_keys
    retriever_env = services["retriever"]["environment"]
    assert searcher.retriever.token.get_secret_value() == retriever_env["RETRIEVER_INTERNAL_TOKEN"]
    llm_port = int(services["llm"]["command"][services["llm"]["command"].index("--port") + 1])
    for name, settings in (("searcher", searcher.policy),
                           ("generator", load_settings("generator", services["generator"]["environment"],
                                                       monkeypatch).llm),
                           ("judge", load_settings("judge", services["judge"]["environment"], monkeypatch).llm)):
        assert settings.base_url == f"http://llm:{llm_port}/v1", name
        # waited for when its profile runs, never required: a default search needs no LLM
        assert services[name]["depends_on"]["llm"] == {"condition": "service_healthy", "required": False}
    assert services["retriever"]["depends_on"]["index"]["condition"] == "service_completed_successfully"
    for name in SERVICES:
        for dep, cond in services[name]["depends_on"].items():
            if dep != "index":
                assert cond["condition"] == "service_healthy", (name, dep)
                assert "healthcheck" in services[dep], dep
    # the index job and the retriever read the same index and corpus
    index_env = services["index"]["environment"]
    assert {k: v for k, v in index_env.items() if k in ("RETRIEVER_CORPUS", "RETRIEVER_INDEX_DIR")} == \
        {k: v for k, v in retriever_env.items() if k in ("RETRIEVER_CORPUS", "RETRIEVER_INDEX_DIR")}


def test_compose_index_job_runs_the_index_cli(compose: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    index = compose["services"]["index"]
    assert index["entrypoint"][0] in console_scripts()
    assert index["build"]["target"] == "retriever"
    with pytest.raises(SystemExit) as exc:
        resolve_script(index["entrypoint"][0])([*index["entrypoint"][1:], *index["command"], "--help"])
    assert exc.value.code == 0
    assert "--corpus" in capsys.readouterr().out


def test_compose_builds_with_the_dockerfile_inputs(compose_raw: dict[str, Any], compose: dict[str, Any],
                                                  dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    """Every image built from docker/Dockerfile gets the same build args (defaults = the Dockerfile's own)
    and the pip secrets; a secret that is not given is an empty file (/dev/null), which the build ignores."""
    args, stages = dockerfile
    built = {name: svc["build"] for name, svc in compose["services"].items()
             if svc.get("build", {}).get("dockerfile") == "docker/Dockerfile"}
    assert set(built) >= {*SERVICES, "llm", "index"}
    for name, build in built.items():
        assert build["context"] == "." and build["target"] in stages, name
        assert set(build["args"]) <= set(args), name
        for key, value in build["args"].items():
            assert value == args[key], (name, key)  # nothing set: the Dockerfile's defaults
        assert set(build["secrets"]) == PIP_SECRETS, name
    assert {k: v["file"] for k, v in compose["secrets"].items()} == {s: "/dev/null" for s in PIP_SECRETS}
    given = interpolate(compose_raw, {"PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER,
                                      "PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER,
                                      "PLUGSEARCH_TORCH_INDEX_URL": "", "PLUGSEARCH_EXTRA_CA_CERTS": "ca.pem",
                                      "PLUGSEARCH_PYTHON_IMAGE": "local/python:3.11"})
    build = given["services"]["searcher"]["build"]
    assert build["args"] == {"PYTHON_IMAGE": "local/python:3.11", "TORCH_INDEX_URL": ""}  # empty stays empty
    assert given["secrets"]["extra_ca_certs"]["file"] == "ca.pem"
    # Redis: any image with redis-server (no registry: the smoke script builds one from Debian's package)
    redis = compose["services"]["redis"]
    assert redis["image"] == "redis:7.2.5-alpine"
    assert redis["command"][redis["command"].index("--protected-mode") + 1] == "no"


def llama_command(args: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What `python -m plugsearch.common.llama_server ARGS` would run (captured, not run)."""
    from plugsearch.common import llama_server

    captured: list[list[str]] = []
    monkeypatch.setattr(llama_server, "serve", lambda cmd, repacking: captured.append(list(cmd)))
    llama_server.main(args)
    assert captured, "llama_server.main did not serve"
    return captured[0]


def test_llm_image_and_compose_command(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                       dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    stage = dockerfile[1]["llm"]
    entry = entrypoint(stage)
    assert entry[:3] == ["python", "-m", "plugsearch.common.llama_server"]
    llm = compose["services"]["llm"]
    cmd = llama_command([*entry[3:], *[str(a) for a in llm["command"]]], monkeypatch)
    port = int(cmd[cmd.index("--port") + 1])
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--model") + 1].endswith(".gguf")
    # /openapi.json answers while a completion holds llama-cpp-python's model lock; /v1/models waits for it
    assert healthcheck_target([str(x) for x in llm["healthcheck"]["test"]], {}) == ("/openapi.json", port)
    assert healthcheck_target(healthcheck_cmd(stage), {}) == ("/openapi.json", port)
    from llama_cpp.server.app import create_app

    paths = {getattr(route, "path", "") for route in create_app.__globals__["router"].routes}
    assert "/v1/models" in paths  # the routes that take the lock; FastAPI adds /openapi.json itself


def test_gpu_profile_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gpu = {name for name, svc in services.items() if "gpu" in svc.get("profiles", [])}
    assert gpu == {"vllm-policy", "vllm-generator", "generator", "judge"}
    gpu = {name for name, svc in services.items() if svc.get("profiles") == ["gpu"]}
    assert gpu == {"vllm-policy", "vllm-generator"}
    for name in gpu:
        svc = services[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert svc["build"]["dockerfile"] == "docker/vllm.Dockerfile"
        port = int(svc["command"][svc["command"].index("--port") + 1])
        assert healthcheck_target([str(x) for x in svc["healthcheck"]["test"]], {}) == ("/health", port)
    gpu_env = dict(line.split("=", 1) for line in (REPO / "deploy" / "compose" / "gpu.env").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert gpu_env["COMPOSE_PROFILES"] == "gpu"
    gpu_compose = interpolate(yaml.safe_load(COMPOSE.read_text()),
                              {**gpu_env, "PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER,
                               "PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER})
    env = gpu_compose["services"]
    assert env["searcher"]["environment"]["SEARCHER_POLICY__BASE_URL"] == "http://vllm-policy:8000/v1"
    assert env["generator"]["environment"]["GENERATOR_LLM__BASE_URL"] == "http://vllm-generator:8000/v1"
    assert env["judge"]["environment"]["JUDGE_LLM__BASE_URL"] == "http://vllm-generator:8000/v1"


def test_gpu_profile_constrains_through_vllm_and_runs_no_llama_cpp(compose: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With gpu.env the policy's constrained decoding uses vLLM's structured outputs (llama.cpp's `grammar`
    field would be ignored by vLLM: constraints silently off) and the llama.cpp service runs no container
    (compose skips waiting on a service scaled to 0); without it, llama.cpp and its grammar."""
    gpu_env = dict(line.split("=", 1) for line in (REPO / "deploy" / "compose" / "gpu.env").read_text().splitlines()
                   if line and not line.startswith("#"))
    gpu = interpolate(yaml.safe_load(COMPOSE.read_text()),
                      {**gpu_env, "PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER,
                       "PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER})["services"]
    for services, style, replicas in ((gpu, "vllm", "0"), (compose["services"], "llama", "1")):
        searcher = load_settings("searcher", {k: str(v) for k, v in services["searcher"]["environment"].items()},
                                 monkeypatch)
        assert searcher.constraint_style == style
        assert str(services["llm"]["deploy"]["replicas"]) == replicas
        if style == "vllm":
            assert searcher.policy.base_url.startswith("http://vllm-policy:")
            for name in ("generator", "judge"):
                settings = load_settings(name, {k: str(v) for k, v in services[name]["environment"].items()},
                                         monkeypatch)
                assert settings.llm.base_url.startswith("http://vllm-generator:"), name


def test_prometheus_scrapes_every_service(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    prom = compose["services"]["prometheus"]
    mount = next(v for v in prom["volumes"] if v.endswith("/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((REPO / mount.split(":")[0]).read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in SERVICES:
        port = load_settings(name, {k: str(v) for k, v in compose["services"][name]["environment"].items()},
                             monkeypatch).port
        assert f"{name}:{port}" in targets
        assert "/metrics" in app_paths(name, monkeypatch)


# -------------------------------------------------------------------------------- Dockerfile rules
def test_dockerfiles_are_slim_pinned_multistage_and_non_root(
        dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    args, stages = dockerfile
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), base
    finals = ["searcher", "generator", "judge", "retriever", "retriever-gpu", "llm", "trainer"]
    builders = {name for name, st in stages.items() if any("build-essential" in a for _, a in st.instructions)}
    for name in finals:
        chain, stage = [], stages[name]
        while stage.base in stages:  # follow FROM <stage> up to the image it starts from
            chain.append(stage.base)
            stage = stages[stage.base]
        assert stage.base == "${PYTHON_IMAGE}", name
        assert not builders & set(chain), f"{name} inherits from a stage with compilers"
        text = " ".join(a for _, a in stages[name].instructions) + " ".join(
            a for n in chain for _, a in stages[n].instructions)
        assert "build-essential" not in text and "cmake" not in text
        copies = [a for k, a in stages[name].instructions if k == "COPY" and a.startswith("--from=build-")]
        assert copies, f"{name} copies its virtualenv from a builder stage"
        users = [a for n in [*reversed(chain), name] for k, a in stages[n].instructions if k == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name} runs as root"
        if name != "trainer":  # a Job, not a service
            healthcheck_cmd(stages[name])
        entry = entrypoint(stages[name])
        if entry[0].startswith("plugsearch-"):
            assert callable(resolve_script(entry[0])), entry
        else:
            assert entry[:2] == ["python", "-m"]
            assert importlib.util.find_spec(entry[2]) is not None, entry


def test_each_image_installs_its_service_extra(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    """A service with its own extra in pyproject (e.g. `retriever`, `generator`) gets it in its image, from
    the lock: its image's subset of requirements/all.txt, hash-checked (scripts/lock_subsets.py)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    stages = dockerfile[1]
    for service in [*SERVICES, "llm", "trainer"]:
        (copy,) = [c for c in stages[service].commands if c.cmd.upper() == "COPY" and c.flags
                   and c.flags[0].startswith("--from=build-")]
        builder = stages[copy.flags[0].split("=", 1)[1]]
        installs = " ".join(" ".join(c.value) for c in builder.commands if c.cmd.upper() == "RUN")
        wanted = "train" if service == "trainer" else service
        lock = wanted if wanted in extras else "core"
        assert wanted not in extras or wanted in LOCK_IMAGES[lock], (service, LOCK_IMAGES)
        assert f"pip install --require-hashes -r requirements/image-{lock}.txt" in installs, (service, installs)
        assert (REPO / "requirements" / f"image-{lock}.txt").is_file(), lock
        # then the project's own code, last (a code change rebuilds only that step)
        last = [c for c in builder.commands if c.cmd.upper() == "RUN"][-1]
        assert "--mount=type=bind,from=source,source=/src,target=/src,rw" in last.flags, (service, last.flags)
        assert " ".join(last.value).endswith("pip install --no-deps --force-reinstall /src"), service


def test_vllm_dockerfile_is_pinned_non_root_with_healthcheck() -> None:
    args, stages = parse_dockerfile(VLLM_DOCKERFILE)
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+(@sha256:[0-9a-f]{64})?", args["VLLM_IMAGE"])
    (stage,) = stages
    user = stage.last("USER")
    assert user is not None and user.value[0].split(":")[0] not in ("root", "0")
    assert healthcheck_target(healthcheck_cmd(stage), {}) == ("/health", 8000)


def test_healthcheck_script(tmp_path: Path) -> None:
    """docker/healthcheck.py: 0 on HTTP 200 from the port named by the env var, 1 otherwise."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(200 if self.path == "/health/ready" else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        script = str(REPO / "docker" / "healthcheck.py")

        def run(*args: str, env: dict[str, str] | None = None) -> int:
            return subprocess.run([sys.executable, script, *args], env={**os.environ, **(env or {})},
                                  timeout=30).returncode

        assert run("/health/ready", "SVC_PORT", "1", env={"SVC_PORT": str(port)}) == 0
        assert run("/health/ready", str(port)) == 0
        assert run("/other", str(port)) == 1
        assert run("/health/ready", "SVC_PORT", str(port), env={"SVC_PORT": "1"}) == 1
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------- Kubernetes
def kustomize(overlay: str) -> list[dict[str, Any]]:
    exe = shutil.which("kubectl")
    assert exe is not None, "kubectl is not installed"
    result = subprocess.run([exe, "kustomize", str(REPO / "k8s" / "overlays" / overlay)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(request.param)


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            spec = doc["spec"]["template"]["spec"]
            for container in spec["containers"]:
                yield doc["metadata"]["name"], container, spec


def test_rendered_objects_validate_against_kubernetes_schemas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    overlay, docs = rendered
    checked = 0
    for doc in docs:
        if doc["apiVersion"] == "monitoring.coreos.com/v1":  # a CRD: no bundled schema, checked below
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 20
    assert all(d["metadata"].get("namespace") == "plugsearch" for d in docs if d["kind"] != "Namespace")


def test_rendered_objects_cover_the_brief(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    deployments = objects(docs, "Deployment")
    assert set(SERVICES) <= set(deployments)
    assert set(objects(docs, "Service")) >= set(SERVICES)
    assert set(objects(docs, "HorizontalPodAutoscaler")) == {"searcher", "generator"}
    assert {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
            for p in objects(docs, "PodDisruptionBudget").values()} >= {"searcher", "retriever", "generator"}
    assert "plugsearch-index" in objects(docs, "Job")
    assert "plugsearch-indexes" in objects(docs, "PersistentVolumeClaim")
    (ingress,) = objects(docs, "Ingress").values()
    backends = {p["backend"]["service"]["name"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]}
    assert backends == {"searcher"}
    policies = objects(docs, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"]["podSelector"] == {}
    assert policies["allow-same-namespace"]["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]
    outside = [p for p in policies.values() for rule in p["spec"].get("ingress", [])
               for src in rule["from"] if "namespaceSelector" in src]
    for policy in outside:  # from outside the namespace: only the searcher, or /metrics scrapes
        selected = policy["spec"]["podSelector"]
        if selected.get("matchLabels", {}).get("app.kubernetes.io/name") == "searcher":
            continue
        assert policy["metadata"]["name"] == "metrics-from-monitoring"
    (monitor,) = objects(docs, "ServiceMonitor").values()
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    named = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    services = objects(docs, "Service")
    for name in SERVICES:
        assert name in named
        assert any(p["name"] == monitor["spec"]["endpoints"][0]["port"] for p in services[name]["spec"]["ports"])
    for name, doc in deployments.items():
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == name and labels["app.kubernetes.io/part-of"] == "plugsearch"
    if overlay == "gpu":
        assert "llm" not in deployments  # vLLM replaces llama.cpp
        train = objects(docs, "Job")["plugsearch-train"]
        assert train["spec"]["suspend"] is True
        assert train["spec"]["template"]["spec"]["containers"][0]["command"][0] in console_scripts()


def test_every_container_has_probes_resources_and_non_root(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    for name, container, pod in containers(docs):
        resources = container["resources"]
        assert resources["requests"] and resources["limits"], name
        context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert context.get("runAsNonRoot") is True and context.get("allowPrivilegeEscalation") is False, name
        owner = next(d for d in docs if d["metadata"]["name"] == name and d["kind"] in ("Deployment", "Job"))
        if owner["kind"] == "Deployment":
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, (name, probe)
        uses_gpu = "nvidia.com/gpu" in resources["limits"]
        if uses_gpu:
            assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
            assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), name
        expected_gpu = overlay == "gpu" and name in ("retriever", "plugsearch-index", "vllm-policy",
                                                     "vllm-generator", "plugsearch-train")
        assert uses_gpu == expected_gpu, name
        for env in container.get("env", []):
            if re.search(r"(TOKEN|API_KEYS?|PASSWORD)$", env["name"]):
                assert "valueFrom" in env and "secretKeyRef" in env["valueFrom"], (name, env["name"])


def k8s_env(container: dict[str, Any]) -> dict[str, str]:
    """Container env with secretKeyRef values replaced by a placeholder."""
    return {e["name"]: e.get("value", SECRET_PLACEHOLDER) for e in container.get("env", [])}


@pytest.mark.parametrize("service", SERVICES)
def test_k8s_service_matches_code(service: str, rendered: tuple[str, list[dict[str, Any]]],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    overlay, docs = rendered
    deployment = objects(docs, "Deployment")[service]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = k8s_env(container)
    cls = settings_class(service)
    unknown = set(env) - env_names(cls, env_prefix(cls))
    assert not unknown, f"{overlay}/{service}: env vars no settings field reads: {sorted(unknown)}"
    settings = load_settings(service, env, monkeypatch)
    assert settings.host == "0.0.0.0"
    # image built from the Dockerfile target of the same name (entrypoint = console script); no override
    image = container["image"].rsplit(":", 1)[0]
    assert image in (f"plugsearch/{service}", f"plugsearch/{service}-gpu")
    assert "command" not in container and "args" not in container
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port}
    paths = app_paths(service, monkeypatch)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] in ("http", settings.port)
        assert get["path"] in paths
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"  # never depends on upstreams
    service_obj = objects(docs, "Service")[service]
    assert service_obj["spec"]["ports"][0]["port"] == settings.port
    assert service_obj["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_k8s_wiring_between_services(rendered: tuple[str, list[dict[str, Any]]],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    overlay, docs = rendered
    deployments = objects(docs, "Deployment")
    services = objects(docs, "Service")

    def settings(name: str) -> Any:
        return load_settings(name, k8s_env(deployments[name]["spec"]["template"]["spec"]["containers"][0]),
                             monkeypatch)

    def service_url(url: str) -> None:
        match = re.fullmatch(r"http://([\w-]+):(\d+)(/v1)?", url)
        assert match, url
        ports = [p["port"] for p in services[match.group(1)]["spec"]["ports"]]
        assert int(match.group(2)) in ports, url

    searcher = settings("searcher")
    service_url(searcher.retriever.url)
    assert searcher.retriever.url.startswith("http://retriever:")
    for llm in (settings("generator").llm, settings("judge").llm):
        service_url(llm.base_url)
    if searcher.policy_kind == "llm":
        service_url(searcher.policy.base_url)
    if overlay == "gpu":
        assert searcher.constraint_style == "vllm"
        assert searcher.policy.base_url.startswith("http://vllm-policy:")
    # the index Job and the retriever read the same corpus and index folder
    job_env = k8s_env(objects(docs, "Job")["plugsearch-index"]["spec"]["template"]["spec"]["containers"][0])
    retriever = settings("retriever")
    job = load_settings("retriever", job_env, monkeypatch)
    assert (job.corpus, job.index_dir, job.bm25_backend, job.dense) == \
        (retriever.corpus, retriever.index_dir, retriever.bm25_backend, retriever.dense)
    if retriever.dense:
        from plugsearch.retriever.encoders.encoder import encoder_identity

        assert job.encoder.name == retriever.encoder.name
        assert encoder_identity(job.encoder) == encoder_identity(retriever.encoder)
        assert job.faiss.index_type == retriever.faiss.index_type


def test_k8s_jobs_run_real_cli_commands(rendered: tuple[str, list[dict[str, Any]]],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each Job's command is a console script whose parser accepts the sub-command, every option name
    and every choice value (argparse checks those before it reaches the trailing --help)."""
    overlay, docs = rendered
    for name, job in objects(docs, "Job").items():
        (container,) = job["spec"]["template"]["spec"]["containers"]
        command = [*container["command"], *container.get("args", [])]
        main = resolve_script(command[0])
        with pytest.raises(SystemExit) as exc:
            main([*command[1:], "--help"])
        assert exc.value.code == 0, (name, capsys.readouterr().err)
        usage = capsys.readouterr().out
        for option in (a.split("=")[0] for a in command[1:] if a.startswith("--")):
            assert option in usage, (name, option)


def test_k8s_trainer_job_matches_trainer_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.trainer.common.settings import TrainerSettings

    docs = kustomize("gpu")
    services = objects(docs, "Service")
    (container,) = objects(docs, "Job")["plugsearch-train"]["spec"]["template"]["spec"]["containers"]
    env = k8s_env(container)
    prefix = env_prefix(TrainerSettings)
    assert not set(env) - env_names(TrainerSettings, prefix) - {"HF_HOME"}
    for key in list(os.environ):
        if key.startswith(prefix):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = TrainerSettings()
    for upstream in ("retriever", "generator", "judge", "searcher"):
        client = getattr(settings, upstream)
        assert client.url == f"http://{upstream}:{services[upstream]['spec']['ports'][0]['port']}"
        assert client.token is not None
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(settings.data_dir) in mounts and str(settings.var_dir) in mounts
    out = container["args"][container["args"].index("--out") + 1]
    assert out.startswith(str(settings.var_dir) + "/")  # checkpoints land on the volume


def test_k8s_llm_command(monkeypatch: pytest.MonkeyPatch,
                         dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    docs = kustomize("cpu")
    (container,) = objects(docs, "Deployment")["llm"]["spec"]["template"]["spec"]["containers"]
    entry = entrypoint(dockerfile[1]["llm"])
    cmd = llama_command([*entry[3:], *container["args"]], monkeypatch)
    port = int(cmd[cmd.index("--port") + 1])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/openapi.json", probe


# ---------------------------------------------------------------------------------- the image package
PACKAGES = ("plugsearch",)
"""The top-level packages pyproject installs (and the Dockerfile copies)."""


def test_the_dockerfile_copies_every_package(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"][
        "include"] == [f"{p}*" for p in PACKAGES]
    copied = [a for k, a in dockerfile[1]["source"].instructions if k == "COPY"]
    for package in PACKAGES:
        assert f"{package} /src/{package}" in copied, package


def dockerignore_includes(patterns: list[str], path: str) -> bool:
    """Whether a context path survives a .dockerignore (last matching pattern wins, `!` re-includes)."""
    included = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern[1:] if negate else pattern
        regex = re.escape(glob.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if re.fullmatch(regex, path) or re.match(regex + "/", path):
            included = negate
    return included


@pytest.mark.parametrize("name", ["Dockerfile", "vllm.Dockerfile", "verl.Dockerfile"])
def test_every_file_a_dockerfile_reads_is_in_its_build_context(name: str) -> None:
    """COPY sources and bind-mounted context folders are not dropped by the Dockerfile's own .dockerignore
    (plugsearch/ once was), and no Dockerfile asks for a frontend from a registry (`# syntax=`)."""
    path = REPO / "docker" / name
    assert not path.read_text().startswith("# syntax="), "BuildKit would fetch the frontend from a registry"
    ignore = REPO / "docker" / f"{name}.dockerignore"
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    sources: list[str] = []
    for stage in parse_dockerfile(path)[1]:
        for command in stage.commands:
            flags = " ".join(command.flags)
            if command.cmd.upper() == "COPY" and "--from=" not in flags:
                sources += list(command.value[:-1])
            for mount in re.findall(r"--mount=(\S+)", flags):
                options = dict(part.split("=", 1) for part in mount.split(",") if "=" in part)
                if options.get("type") == "bind" and "from" not in options:
                    sources.append(options["source"])
    assert sources
    for source in sources:
        target = REPO / source
        files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()
                                                    and "__pycache__" not in p.parts and p.suffix != ".pyc"]
        assert files, source
        for file in files:
            assert dockerignore_includes(patterns, file.relative_to(REPO).as_posix()), (name, file)


# ------------------------------------------------------------------------------------ build inputs
PIP_SECRETS = {"extra_ca_certs", "pip_conf"}


def test_every_pip_install_takes_the_build_time_inputs_and_keeps_none(
        dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    """A proxy CA and a package index reach every pip call as BuildKit secrets (files under /run/secrets
    during that step only), through docker/pip-install.sh; nothing puts them in a layer or an ENV."""
    pip_runs = 0
    for stage in dockerfile[1].values():
        for command in stage.commands:
            text = " ".join(command.value)
            if command.cmd.upper() == "ENV":
                assert not re.search(r"PIP_(CERT|INDEX_URL|EXTRA_INDEX_URL|CONFIG_FILE)|SSL_CERT|CA_BUNDLE", text)
            if command.cmd.upper() != "RUN" or not re.search(r"\bpip (install|wheel)\b", text):
                continue
            pip_runs += 1
            secrets = {m for m in re.findall(r"--mount=type=secret,id=(\w+)", " ".join(command.flags))}
            assert secrets == PIP_SECRETS, (stage.name, command.flags)
            # every pip call of the step goes through the helper
            for call in re.split(r"&&", text):
                if re.search(r"\bpip (install|wheel)\b", call) and "uninstall" not in call:
                    assert re.search(r"\bpip-install\b", call), (stage.name, call)
    assert pip_runs >= 12
    helper = (REPO / "docker" / "pip-install.sh").read_text()
    for secret in PIP_SECRETS:
        assert f"/run/secrets/{secret}" in helper
    assert 'rm -f "$bundle"' in helper  # the combined CA bundle never outlives the step


def test_the_cpu_retriever_gets_cpu_torch_and_fails_on_cuda(dockerfile: tuple[dict[str, str], dict[str, Stage]]
                                                            ) -> None:
    args, stages = dockerfile
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    (first, *_) = [" ".join(c.value) for c in stages["build-retriever"].commands if c.cmd.upper() == "RUN"]
    torch_at = first.index('pip install --no-deps -r requirements/torch.txt ${TORCH_INDEX_URL:+--index-url')
    assert torch_at < first.index("-r requirements/image-retriever.txt")
    assert LOCK_IMAGES["retriever"] == ["retriever", "onnx", "otel"]  # onnx: RETRIEVER_ENCODER__BACKEND=onnx
    assert "torch.version.cuda" in first and "grep -i '^nvidia-'" in first


def test_the_retriever_image_ships_the_default_encoders_onnx_export(
        dockerfile: tuple[dict[str, str], dict[str, Stage]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The default encoder backend (auto) serves MiniLM on ONNX Runtime: the image makes that export at build
    time (failing where the default would fall back to torch) into the folder its env names, writable by the
    service's user; the CPU pods neither override the backend nor mount anything over that folder."""
    _, stages = dockerfile
    (export,) = [" ".join(c.value) for c in stages["retriever-onnx"].commands if c.cmd.upper() == "RUN"]
    assert stages["retriever-onnx"].base == "build-retriever"
    built_into = re.search(r"RETRIEVER_ENCODER__ONNX_DIR=(\S+)", export)
    assert built_into and "plugsearch-index encoder --require-onnx" in export
    (copy,) = [c for c in stages["retriever"].commands if c.cmd.upper() == "COPY"
               and "--from=retriever-onnx" in c.flags]
    assert "--chown=10001:10001" in copy.flags and copy.value[0] == built_into.group(1)
    env = {c.value[i]: c.value[i + 1] for c in stages["retriever"].commands if c.cmd.upper() == "ENV"
           for i in range(0, len(c.value), 2)}
    assert env["RETRIEVER_ENCODER__ONNX_DIR"] == copy.value[1]
    settings = load_settings("retriever", {"RETRIEVER_ENCODER__ONNX_DIR": env["RETRIEVER_ENCODER__ONNX_DIR"]},
                             monkeypatch)
    assert settings.encoder.backend == "auto" and str(settings.encoder.onnx_dir) == copy.value[1]
    for overlay in ("cpu", "scale"):
        for name, container, _pod in containers(kustomize(overlay)):
            if container["image"].split(":")[0] == "plugsearch/retriever":
                assert not {"RETRIEVER_ENCODER__BACKEND", "RETRIEVER_ENCODER__ONNX_DIR"} & set(k8s_env(container))
                mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
                assert not [m for m in mounts if copy.value[1].startswith(m)], (overlay, name, mounts)


def test_llama_cpp_compiles_in_a_stage_of_its_own(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    """The compiled wheel depends on its locked version only: no project file but requirements/llama-cpp.txt
    (its one pin, hash-checked) reaches that stage, and the llm builder installs that wheel before its lock,
    which pins the same version (so nothing compiles again)."""
    args, stages = dockerfile
    chain, stage = ["build-llama-cpp"], stages["build-llama-cpp"]
    while stage.base in stages:
        chain.append(stage.base)
        stage = stages[stage.base]
    for name in chain:
        for keyword, arg in stages[name].instructions:
            assert keyword != "COPY" or arg.startswith("docker/"), (name, arg)
            assert "pyproject" not in arg and "/src" not in arg, (name, arg)
    (build,) = [c for c in stages["build-llama-cpp"].commands if c.cmd.upper() == "RUN"]
    mounts = [m for m in re.findall(r"--mount=(\S+)", " ".join(build.flags)) if "type=bind" in m]
    assert sorted(dict(p.split("=", 1) for p in m.split(","))["source"] for m in mounts) == [
        "docker/wheels", "requirements/llama-cpp.txt"]
    assert "pip wheel --no-deps --require-hashes --wheel-dir /opt/llama-wheels -r /tmp/llama-cpp.txt" in \
        " ".join(build.value)
    llm = " ".join(" ".join(c.value) for c in stages["build-llm"].commands)
    assert "--from=build-llama-cpp" in " ".join(a for _, a in stages["build-llm"].instructions)
    assert llm.index("install --no-deps /opt/llama-wheels/") < llm.index("-r requirements/image-llm.txt")
    pin = (REPO / "requirements" / "llama-cpp.txt").read_text()
    (line,) = [x for x in pin.splitlines() if x.startswith("llama-cpp-python==")]
    assert line in (REPO / "requirements" / "image-llm.txt").read_text().splitlines()


def test_the_installed_package_has_every_entrypoint_and_data_file(tmp_path: Path,
                                                                  compose: dict[str, Any]) -> None:
    """Images `pip install .` (not editable): build that wheel from a copy of the sources and check it
    ships every console script the images, compose and Kubernetes run and every data file the code reads."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=ignore)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("plugsearch-*.whl")
    import configparser
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode())
    scripts = dict(entry_points["console_scripts"])
    assert scripts == console_scripts()
    for target in scripts.values():  # every console script's module is in the wheel
        module = target.split(":")[0].replace(".", "/")
        assert f"{module}.py" in names or f"{module}/__init__.py" in names, target
    data_files = {p.relative_to(src).as_posix() for package in PACKAGES
                  for p in (src / package).rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert not data_files - names, f"left out of the installed package: {sorted(data_files - names)}"

    used: set[str] = set()
    for path in (DOCKERFILE,):
        for stage in parse_dockerfile(path)[1]:
            if stage.last("ENTRYPOINT") is not None:
                used.add(entrypoint(stage)[0])
    for svc in compose["services"].values():
        if svc.get("entrypoint"):
            used.add(svc["entrypoint"][0])
    for overlay in OVERLAYS:
        for _, container, _ in containers(kustomize(overlay)):
            if container.get("command"):
                used.add(container["command"][0])
    plugsearch = {name for name in used if name.startswith("plugsearch-")}
    assert plugsearch and plugsearch <= set(scripts)
    assert used - plugsearch <= {"python"}


# ----------------------------------------------------------- the compact policy wherever it is deployed
def env_file(name: str) -> dict[str, str]:
    text = (REPO / "deploy" / "compose" / name).read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def check_compact_pair(searcher: Any, retriever: Any) -> None:
    """The searcher serves the packaged compact policy, and the retriever serves the pool it was trained on:
    BM25, and dense with the very encoder its dense scorer read (a mismatch would drop it to the lexical scorer)."""
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.trained import COMPACT_DIR

    assert searcher.policy_kind == "compact" and searcher.compact_policy == COMPACT_DIR
    policy = CompactPolicy.load(searcher.compact_policy)
    assert policy.setting is not None and policy.setting.pool_methods == ["bm25", "dense"]
    assert retriever.bm25 and retriever.dense and retriever.default_method == policy.setting.method
    assert policy.pool_methods(retriever.methods(), retriever.encoder.name) == ["bm25", "dense"]
    # the setting comes from the manifest, inside the service: no deployment file repeats it
    assert not {"retrieve_k", "select_k", "max_turns"} & searcher.model_fields_set


def test_compose_serves_the_compact_policy_by_default_and_needs_no_llm(compose: dict[str, Any],
                                                                        compose_raw: dict[str, Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose["services"]

    def env_of(name: str, where: dict[str, Any] = services) -> dict[str, str]:
        return {k: str(v) for k, v in where[name]["environment"].items() if not k.startswith("OTEL_")}

    searcher = load_settings("searcher", env_of("searcher"), monkeypatch)
    retriever = load_settings("retriever", env_of("retriever"), monkeypatch)
    check_compact_pair(searcher, retriever)
    # the dense index: built by the retriever on its first start while BM25 serves (the volume is writable for
    # it); the one-shot index service builds the store and BM25 only, for the same settings
    assert retriever.dense_missing == "build" and not any(v.endswith(":ro") and "indexes" in v
                                                          for v in services["retriever"]["volumes"])
    assert services["index"]["command"] == ["build", "--no-dense"]
    index = load_settings("retriever", env_of("index"), monkeypatch)
    assert (index.dense, index.encoder, index.faiss.index_type) == (retriever.dense, retriever.encoder,
                                                                    retriever.faiss.index_type)
    # `docker compose up` starts what a search needs: the LLM-backed services are in profiles
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == {"redis", "index", "retriever", "searcher"}
    required = {dep for dep, cond in services["searcher"]["depends_on"].items() if cond.get("required", True)}
    assert required == {"redis", "retriever"}
    # the LLM policy is one setting away: llm.env (CPU, llama.cpp) and gpu.env (vLLM)
    for name, profile in (("llm.env", "llm"), ("gpu.env", "gpu")):
        extra = env_file(name)
        assert extra["COMPOSE_PROFILES"] == profile and extra["SEARCHER_POLICY_KIND"] == "llm"
        switched = interpolate(compose_raw, {**extra, "PLUGSEARCH_API_KEYS": SECRET_PLACEHOLDER,
                                             "PLUGSEARCH_INTERNAL_TOKEN": SECRET_PLACEHOLDER})["services"]
        llm = load_settings("searcher", env_of("searcher", switched), monkeypatch)
        assert llm.policy_kind == "llm" and {"generator", "judge"} <= {
            n for n, svc in switched.items() if profile in svc.get("profiles", [])}
        if profile == "llm":
            assert llm.constrained  # the untrained SmolLM2 writes valid actions only under the grammar
            assert services["llm"]["profiles"] == ["llm"]


def test_kubernetes_serves_the_compact_policy_by_default(rendered: tuple[str, list[dict[str, Any]]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    overlay, docs = rendered
    deployments = objects(docs, "Deployment")

    def settings(name: str, doc: dict[str, Any]) -> Any:
        return load_settings(name, k8s_env(doc["spec"]["template"]["spec"]["containers"][0]), monkeypatch)

    searcher, retriever = settings("searcher", deployments["searcher"]), settings("retriever", deployments["retriever"])
    job = settings("retriever", objects(docs, "Job")["plugsearch-index"])
    if overlay == "gpu":  # vLLM: the LLM policy (the E5 retriever's cosines would not fit the compact scorer)
        assert searcher.policy_kind == "llm" and retriever.dense_missing == "refuse"
        return
    check_compact_pair(searcher, retriever)
    # the Job builds BM25 then dense; the retriever serves BM25 from the start and loads the dense index once written
    assert job.dense and retriever.dense_missing == "wait"
