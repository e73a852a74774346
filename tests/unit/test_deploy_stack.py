"""Unit tests of `plugsearch-stack`'s pieces (ports, process table, corpus choice, readiness) without
starting the stack; tests/e2e/test_stack.py starts it for real."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugsearch.common import procgroup
from plugsearch.common.workers import free_port, port_is_free
from plugsearch.stack import StackError
from plugsearch.stack.cli import _parse_args, curl_example, main
from plugsearch.stack.corpus import (
    SAMPLE_NAME,
    check_first_passage,
    download_sample,
    index_dir_for,
    resolve_corpus,
)
from plugsearch.stack.policy import _trained_policy, serve_dense
from plugsearch.stack.specs import (
    BASE_OFFSETS,
    DEFAULT_PORTS,
    REDIS_DB,
    StackOptions,
    allocate_ports,
    build_specs,
    default_llm_threads,
    index_command,
    missing_llm_packages,
)
from tests.support.http import QuietHandler, http_server
from tests.unit.test_deploy_config import (
    SERVICES,
    console_scripts,
    env_names,
    env_prefix,
    llama_command,
    load_settings,
    settings_class,
)

REPO = Path(__file__).resolve().parents[2]


def make_options(tmp_path: Path, **overrides: Any) -> StackOptions:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "d1", "title": "T", "text": "x"}\n')
    values: dict[str, Any] = {"ports": allocate_ports(free_ports=True), "corpus": corpus,
                              "index_dir": tmp_path / "idx", "internal_token": "internal-token-0123456789"}
    values.update(overrides)
    return StackOptions(**values)


# ------------------------------------------------------------------------------------------- ports
def test_free_ports_are_distinct_and_free() -> None:
    ports = allocate_ports(free_ports=True)
    assert set(ports) == set(DEFAULT_PORTS)
    assert len(set(ports.values())) == len(ports)
    assert all(port_is_free(p) for p in ports.values())


def test_base_port_layout_and_busy_port_refused() -> None:
    for _ in range(50):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            base = taken - BASE_OFFSETS["generator"]
            others = [base + off for name, off in BASE_OFFSETS.items() if name != "generator"]
            if base < 1024 or not all(port_is_free(port) for port in others):
                continue  # a neighbour is used by something else on this machine: try another range
            with pytest.raises(StackError, match=rf"generator {taken}.*--free-ports"):
                allocate_ports(base_port=base)
            break
    else:
        pytest.fail("no port range with only the generator's port taken")
    assert allocate_ports(base_port=base) == {name: base + off for name, off in BASE_OFFSETS.items()}
    with pytest.raises(StackError):
        allocate_ports(base_port=80)


def test_a_port_left_in_time_wait_by_a_stopped_stack_counts_as_free() -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    assert not port_is_free(port)  # listening
    accepted.close()  # the server side closes first: its port is left in TIME_WAIT
    client.close()
    server.close()
    assert port_is_free(port)  # what redis-server / uvicorn (SO_REUSEADDR) can bind again


def test_cli_reports_a_busy_port_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main(["--base-port", str(busy.getsockname()[1]), "--no-color"])
    assert code == 2
    assert "already in use" in capsys.readouterr().out


def test_default_llm_threads() -> None:
    assert default_llm_threads(2) == 1
    assert default_llm_threads(8) == 4
    assert default_llm_threads(64) == 4


# --------------------------------------------------------------------------------- process table
@pytest.mark.parametrize("service", SERVICES)
def test_service_env_is_what_the_settings_class_reads(service: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    options = make_options(tmp_path, api_keys=["public-key-123"])
    specs = {s.name: s for s in build_specs(options, redis_server="/usr/bin/redis-server")}
    spec = specs[service]
    cls = settings_class(service)
    assert not set(spec.env) - env_names(cls, env_prefix(cls))
    settings = load_settings(service, spec.env, monkeypatch)
    assert (settings.host, settings.port) == ("127.0.0.1", options.ports[service])
    if service == "retriever":  # keeps no result cache (its settings refuse a Redis URL)
        assert settings.redis_url is None and service not in REDIS_DB
    else:  # with the run's Redis password (the URL is a SecretStr)
        assert settings.redis_url is not None and settings.redis_url.get_secret_value() == (
            f"redis://:{options.redis_password}@127.0.0.1:{options.ports['redis']}/{REDIS_DB[service]}")
    assert spec.ready_url == f"http://127.0.0.1:{options.ports[service]}/health/ready"
    # `python -m plugsearch.<svc>` is what the console script plugsearch-<svc> runs
    assert spec.argv == [sys.executable, "-m", f"plugsearch.{service}"]
    assert console_scripts()[f"plugsearch-{service}"] == f"plugsearch.{service}.__main__:main"


def test_services_are_wired_to_each_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = make_options(tmp_path)
    specs = {s.name: s for s in build_specs(options, redis_server="/usr/bin/redis-server")}
    assert list(specs) == ["redis", "llm", "retriever", "generator", "judge", "searcher"]
    retriever = load_settings("retriever", specs["retriever"].env, monkeypatch)
    assert retriever.corpus == options.corpus and retriever.index_dir == options.index_dir
    searcher = load_settings("searcher", specs["searcher"].env, monkeypatch)
    assert searcher.retriever.url == f"http://127.0.0.1:{options.ports['retriever']}"
    assert searcher.retriever.token.get_secret_value() == retriever.internal_token.get_secret_value()
    assert searcher.api_keys == [] and searcher.internal_token is None  # no key: /search open on loopback
    llm_cmd = llama_command(specs["llm"].argv[3:], monkeypatch)
    llm_port = int(llm_cmd[llm_cmd.index("--port") + 1])
    assert specs["llm"].ready_url == f"http://127.0.0.1:{llm_port}/v1/models"
    for name in ("generator", "judge"):
        llm = load_settings(name, specs[name].env, monkeypatch).llm
        assert llm.base_url == f"http://127.0.0.1:{llm_port}/v1"
    assert searcher.policy.base_url == f"http://127.0.0.1:{llm_port}/v1"
    assert searcher.constrained is True  # the embedded SmolLM2 needs the grammar to emit valid actions
    assert searcher.ui is True  # the playground at /ui: on in the local stack, off by default in the service
    external = {s.name: s for s in build_specs(make_options(tmp_path, llm_url="http://gpu:8000/v1"),
                                                     redis_server=None)}
    assert load_settings("searcher", external["searcher"].env, monkeypatch).constrained is False
    redis = specs["redis"].argv
    assert redis[redis.index("--port") + 1] == str(options.ports["redis"])
    assert "-H 'Authorization" not in curl_example(options)


def test_redis_and_the_llm_get_per_run_secrets_never_on_a_command_line(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.common import llama_server

    options, other = make_options(tmp_path), make_options(tmp_path)
    assert options.redis_password != other.redis_password and options.llm_api_key != other.llm_api_key
    assert options.redis_password not in repr(options) and options.llm_api_key not in repr(options)
    specs = {s.name: s for s in build_specs(options, redis_server="/usr/bin/redis-server")}
    for spec in specs.values():  # every local user can list arguments; only the same user reads the env
        assert options.redis_password not in " ".join(spec.argv) and options.llm_api_key not in " ".join(spec.argv)
    assert specs["redis"].env == {"PLUGSEARCH_REDIS_PASSWORD": options.redis_password}
    assert specs["redis"].ready_secret == options.redis_password
    assert specs["llm"].env == {llama_server.API_KEY_ENV: options.llm_api_key}
    assert specs["llm"].ready_secret == options.llm_api_key
    for name in ("generator", "judge"):
        assert load_settings(name, specs[name].env, monkeypatch).llm.api_key.get_secret_value() == options.llm_api_key
    searcher = load_settings("searcher", specs["searcher"].env, monkeypatch)
    assert searcher.policy.api_key is not None and searcher.policy.api_key.get_secret_value() == options.llm_api_key
    # the llama.cpp process hands the key to llama-cpp-python as its API_KEY setting, not as an argument
    captured: list[tuple[list[str], str | None]] = []
    monkeypatch.setattr(llama_server, "serve", lambda cmd, repacking: captured.append(
        (list(cmd), llama_server.os.environ.get("API_KEY"))))
    monkeypatch.setattr(llama_server, "smollm2_gguf_path", lambda: Path("/m.gguf"))
    monkeypatch.setenv("API_KEY", "something-else")
    monkeypatch.setenv(llama_server.API_KEY_ENV, options.llm_api_key)
    llama_server.main(specs["llm"].argv[3:])
    cmd, key = captured[0]
    assert key == options.llm_api_key and options.llm_api_key not in " ".join(cmd)
    assert llama_server.API_KEY_ENV not in llama_server.os.environ
    # an external endpoint gets no key of ours
    external = {s.name: s for s in build_specs(make_options(tmp_path, llm_url="http://gpu:8000/v1"))}
    assert load_settings("searcher", external["searcher"].env, monkeypatch).policy.api_key is None


def test_redis_requires_the_password_and_the_probe_presents_it(tmp_path: Path) -> None:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (scripts/install.sh installs it)")
    options = make_options(tmp_path)
    spec = {s.name: s for s in build_specs(options, redis_server=exe)}["redis"]
    proc = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not procgroup.probe(spec):
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
        with socket.create_connection(("127.0.0.1", spec.port), timeout=5) as sock:
            sock.sendall(b"GET plugsearch:search:x\r\n")
            assert sock.recv(64).startswith(b"-NOAUTH")  # any other local process is refused
        assert not procgroup.probe(procgroup.ProcessSpec("redis", [], port=spec.port))  # without the password
        assert not procgroup.probe(procgroup.ProcessSpec("redis", [], port=spec.port, ready_secret="wrong"))
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert options.redis_password.encode() not in cmdline and b"redis-server" in cmdline  # it is Redis itself
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert options.redis_password.encode() not in environ  # read once, then dropped
        with socket.create_connection(("127.0.0.1", spec.port), timeout=5) as sock:  # a capped cache
            password = options.redis_password.encode()
            sock.sendall(b"AUTH " + password + b"\r\nCONFIG GET maxmemory*\r\n")
            reply = b""
            while reply.count(b"\r\n") < 10:
                reply += sock.recv(4096)
            assert b"536870912" in reply and b"allkeys-lru" in reply, reply
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_api_key_external_llm_and_no_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = make_options(tmp_path, api_keys=["public-key-123"], llm_url="http://gpu-box:8000/v1",
                           llm_model="Qwen/Qwen2.5-7B-Instruct", redis=False)
    specs = {s.name: s for s in build_specs(options, redis_server="/usr/bin/redis-server")}
    assert list(specs) == ["retriever", "generator", "judge", "searcher"]
    searcher = load_settings("searcher", specs["searcher"].env, monkeypatch)
    assert [k.get_secret_value() for k in searcher.api_keys] == ["public-key-123"]
    assert (searcher.policy.base_url, searcher.policy.model) == ("http://gpu-box:8000/v1", "Qwen/Qwen2.5-7B-Instruct")
    assert searcher.redis_url is None
    example = curl_example(options)
    assert "Authorization: Bearer $PLUGSEARCH_API_KEY" in example
    assert "public-key-123" not in example  # the key is never printed
    body = curl_example(options).rsplit("-d '", 1)[1].rstrip("'")
    assert json.loads(body)["question"]


def test_each_api_key_option_is_one_key_commas_included(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`--api-key "k1,k2"` used to become two keys silently (the searcher splits `SEARCHER_API_KEYS` at commas):
    each --api-key is one key, as written; several keys are several options."""
    monkeypatch.delenv("PLUGSEARCH_API_KEY", raising=False)

    def keys(*argv: str) -> list[str]:
        options = make_options(tmp_path, api_keys=_parse_args(list(argv)).api_key)
        spec = next(s for s in build_specs(options) if s.name == "searcher")
        return [k.get_secret_value() for k in load_settings("searcher", spec.env, monkeypatch).api_keys]

    assert keys("--api-key", "first-key-123,second-key-456") == ["first-key-123,second-key-456"]
    assert keys("--api-key", "first-key-123", "--api-key", "second-key-456") == ["first-key-123", "second-key-456"]
    assert keys() == []
    monkeypatch.setenv("PLUGSEARCH_API_KEY", "env-key-1,env-key-2")
    assert keys() == ["env-key-1,env-key-2"]  # the variable names one key too
    for argv in (["--api-key", "k1,k2"], ["--api-key", "same-key-123", "--api-key", "same-key-123"]):
        with pytest.raises(SystemExit):
            _parse_args(argv)
    assert "--api-key given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse_args(["--help"])
    assert "a comma is part of the key" in " ".join(capsys.readouterr().out.split())


def test_index_command_uses_the_index_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = make_options(tmp_path)
    argv, env = index_command(options)
    assert argv[1:] == ["-m", "plugsearch.retriever.cli", "build"]
    assert console_scripts()["plugsearch-index"] == "plugsearch.retriever.cli:main"
    assert env == {"RETRIEVER_CORPUS": str(options.corpus), "RETRIEVER_INDEX_DIR": str(options.index_dir)}


# -------------------------------------------------------------------------------------------- corpus
@pytest.fixture()
def http_files(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local static file server (the download path without the internet)."""
    root = tmp_path / "www"
    root.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler, QuietHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

    with http_server(Handler) as url:
        yield url, root


def test_corpus_choice(tmp_path: Path) -> None:
    data, var = tmp_path / "data", tmp_path / "var"
    with pytest.raises(StackError, match="no corpus"):
        resolve_corpus(None, data_dir=data, var_dir=var, download=False)
    (data / "corpus").mkdir(parents=True)
    shared = data / "corpus" / "combined.jsonl"
    shared.write_text('{"id": "a", "title": "A", "text": "aa"}\n')
    assert resolve_corpus(None, data_dir=data, var_dir=var, download=False) == shared.resolve()
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "1", "contents": "\\"T\\"\\ntext"}\n')
    assert resolve_corpus(mine, data_dir=data, var_dir=var) == mine.resolve()
    with pytest.raises(StackError, match="not a file"):
        resolve_corpus(tmp_path / "missing.jsonl", data_dir=data, var_dir=var)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no id"}\n')
    with pytest.raises(StackError, match="needs an `id`"):
        resolve_corpus(bad, data_dir=data, var_dir=var)
    unreadable = tmp_path / "folder.jsonl"
    unreadable.mkdir()  # a read error, whoever runs the test (root reads any file)
    with pytest.raises(StackError, match="cannot read corpus") as raised:
        check_first_passage(unreadable)
    assert "each line needs" not in str(raised.value)


def test_sample_download(tmp_path: Path, http_files: tuple[str, Path]) -> None:
    base, root = http_files
    (root / "sample.jsonl").write_text('{"id": "0", "contents": "\\"Evan Morris\\"\\nEvan Morris was"}\n')
    (root / "page.html").write_text("<html>not a corpus</html>")
    messages: list[str] = []
    dest = tmp_path / "var" / "corpus" / SAMPLE_NAME
    assert download_sample(dest, f"{base}/sample.jsonl", log=messages.append) == dest
    assert json.loads(dest.read_text())["id"] == "0"
    assert "downloading a public sample corpus" in messages[0] and "--corpus" in messages[0]
    assert download_sample(dest, f"{base}/gone.jsonl", log=messages.append) == dest  # cached: no fetch
    assert len(messages) == 1
    other = tmp_path / "other.jsonl"
    with pytest.raises(StackError, match="could not download"):
        download_sample(other, f"{base}/page.html", log=messages.append)
    with pytest.raises(StackError, match="could not download"):
        download_sample(other, f"{base}/gone.jsonl", log=messages.append)
    assert not other.exists() and not list(tmp_path.glob(".other.jsonl.*"))


def test_index_dir_is_keyed_by_corpus_content(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a" / "corpus.jsonl", tmp_path / "b" / "corpus.jsonl", tmp_path / "c" / "corpus.jsonl"
    for path, text in ((a, "one"), (b, "one"), (c, "two")):
        path.parent.mkdir()
        path.write_text(f'{{"id": "1", "text": "{text}"}}\n')
    var = tmp_path / "var"
    assert index_dir_for(a, var) == index_dir_for(b, var)
    assert index_dir_for(a, var) != index_dir_for(c, var)
    assert index_dir_for(a, var).parent == (var / "indexes").resolve()
    assert index_dir_for(a, var).name.startswith("corpus-")


# ------------------------------------------------------------------------------------------ readiness
def test_wait_ready_polls_until_every_check_passes() -> None:
    state = {"calls": 0}

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            state["calls"] += 1
            self.send_response(200 if state["calls"] >= 3 else 503)
            self.end_headers()

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with http_server(Handler) as base, procgroup.ProcessGroup() as group:
        group.add(procgroup.ProcessSpec("svc", sleeper, ready_url=f"{base}/health/ready"),
                  procgroup.ProcessSpec("down", sleeper, ready_url=f"http://127.0.0.1:{free_port()}/x"))
        group.start()
        ready: list[str] = []
        group.wait_ready("svc", timeout_s=30, stop=threading.Event(), on_ready=lambda name, _s: ready.append(name),
                         interval_s=0.01)
        assert ready == ["svc"] and state["calls"] == 3
        with pytest.raises(procgroup.ProcessNotReady) as late:
            group.wait_ready("down", "svc", timeout_s=0.2, stop=threading.Event(),
                             on_ready=lambda name, _s: ready.append(name), interval_s=0.01)
        assert late.value.names == ["down"] and ready == ["svc", "svc"]
        stop = threading.Event()
        stop.set()
        group.wait_ready("down", timeout_s=30, stop=stop, on_ready=lambda *_: None)  # returns at once, not ready


def test_redis_probe_uses_ping(redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    assert procgroup.probe(procgroup.ProcessSpec("redis", [], port=port))
    assert not procgroup.probe(procgroup.ProcessSpec("redis", [], port=free_port()))


def test_llm_process_gets_threads_and_prompt_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.common import llama_server

    spec = {s.name: s for s in build_specs(make_options(tmp_path, llm_threads=3, llm_prompt_cache_mb=64))}["llm"]
    assert spec.argv[1:3] == ["-m", "plugsearch.common.llama_server"]
    captured: list[list[str]] = []
    monkeypatch.setattr(llama_server, "serve", lambda cmd, repacking: captured.append(list(cmd)))
    monkeypatch.setattr(llama_server, "smollm2_gguf_path", lambda: Path("/m.gguf"))
    llama_server.main(spec.argv[3:])  # what the process would run
    cmd = captured[0]
    assert cmd[cmd.index("--n_threads") + 1] == "3"
    assert cmd[cmd.index("--cache_size") + 1] == str(64 << 20)
    assert _parse_args(["--llm-prompt-cache-mb", "0"]).llm_prompt_cache_mb == 0


# --------------------------------------------------------------------------------- trained searcher
def fake_trained(folder: Path, *, base_sha: str | None = None, beats_base: bool = True) -> Any:
    from plugsearch.searcher.trained import ADAPTER, MANIFEST, TrainedSearcher, sha256

    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER).write_bytes(b"GGUF adapter bytes")
    prompts = folder / "prompts"
    prompts.mkdir(exist_ok=True)
    (prompts / "s3.system.txt").write_text("Mark at most $select_k ids.")
    manifest = {"adapter_sha256": sha256(folder / ADAPTER), "model_alias": "smollm2-135m-searcher",
                "search": {"mode": "s3", "max_turns": 1, "retrieve_k": 5, "select_k": 3, "doc_chars": 200,
                           "max_new_tokens": 64}, "evaluation": {"beats_base": beats_base}}
    if base_sha:
        manifest["base_gguf_sha256"] = base_sha
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return TrainedSearcher.load(folder)


def test_the_trained_searcher_gets_its_own_llm_process_and_its_settings(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    trained = fake_trained(tmp_path / "trained")
    options = make_options(tmp_path, trained=trained)
    specs = {s.name: s for s in build_specs(options, redis_server=None)}
    assert list(specs) == ["llm", "retriever", "generator", "judge", "policy", "searcher"]
    policy_cmd = llama_command(specs["policy"].argv[3:], monkeypatch)
    assert policy_cmd[policy_cmd.index("--lora_path") + 1] == str(trained.adapter)
    assert policy_cmd[policy_cmd.index("--model_alias") + 1] == "smollm2-135m-searcher"
    assert int(policy_cmd[policy_cmd.index("--port") + 1]) == options.ports["policy"]
    assert "--lora_path" not in llama_command(specs["llm"].argv[3:], monkeypatch)  # generator/judge: plain model
    searcher = load_settings("searcher", specs["searcher"].env, monkeypatch)
    assert searcher.policy.base_url == f"http://127.0.0.1:{options.ports['policy']}/v1"
    assert searcher.policy.model == "smollm2-135m-searcher"
    # its setting travels in its manifest, as a compact policy's does: no SEARCHER_MAX_TURNS etc. from the stack
    assert not [k for k in specs["searcher"].env if k.startswith(("SEARCHER_RETRIEVE_K", "SEARCHER_MAX_TURNS",
                                                                    "SEARCHER_SELECT_K"))]
    assert searcher.policy_manifest == trained.folder / "manifest.json"
    from plugsearch.searcher.policy import ChatPolicy

    setting = ChatPolicy(object(), manifest=searcher.chat_manifest()).setting  # type: ignore[arg-type]
    assert setting is not None and (setting.max_turns, setting.retrieve_k, setting.select_k) == (1, 5, 3)
    assert searcher.doc_chars == 200
    assert searcher.prompts_dir == trained.prompts_dir and searcher.constrained is True


def test_an_altered_adapter_or_another_base_model_is_refused(tmp_path: Path) -> None:
    from plugsearch.searcher.trained import ADAPTER, TrainedSearcher, TrainedSearcherError

    trained = fake_trained(tmp_path / "t", base_sha="0" * 64)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    with pytest.raises(TrainedSearcherError, match="--policy base"):
        trained.check_base(other)
    (trained.folder / ADAPTER).write_bytes(b"tampered")
    with pytest.raises(TrainedSearcherError, match="does not match"):
        TrainedSearcher.load(trained.folder)
    with pytest.raises(TrainedSearcherError, match="no trained searcher"):
        TrainedSearcher.load(tmp_path / "missing")


def test_policy_choice(tmp_path: Path) -> None:
    said: list[str] = []
    assert _trained_policy(_parse_args(["--policy", "base"]), said.append) is None
    assert "untrained" in said[-1]
    none = tmp_path / "none"
    assert _trained_policy(_parse_args([]), said.append, none) is None  # auto, nothing shipped: base
    with pytest.raises(StackError, match="--policy base"):
        _trained_policy(_parse_args(["--policy", "trained"]), said.append, none)
    from plugsearch.common.llama_server import smollm2_gguf_path
    from plugsearch.searcher.trained import sha256

    base = sha256(smollm2_gguf_path())
    better = fake_trained(tmp_path / "better", base_sha=base).folder
    worse = fake_trained(tmp_path / "worse", base_sha=base, beats_base=False).folder
    assert _trained_policy(_parse_args([]), said.append, better) is not None
    assert _trained_policy(_parse_args([]), said.append, worse) is None  # auto: only a winner
    assert "did not beat" in said[-1]
    assert _trained_policy(_parse_args(["--policy", "trained"]), said.append, worse) is not None


def test_a_dense_stack_builds_and_serves_the_dense_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_searcher_compact import DENSE_READER, NAME_SEEKER

    options = make_options(tmp_path, compact=DENSE_READER, dense=True)
    specs = {s.name: s for s in build_specs(options, redis_server=None)}
    retriever = load_settings("retriever", specs["retriever"].env, monkeypatch)
    assert retriever.dense and retriever.bm25 and retriever.faiss.index_type == "flat"
    assert "hybrid" in retriever.methods()
    argv, env = index_command(options)  # the first step builds BM25; the retriever builds the dense index
    assert env["RETRIEVER_DENSE"] == "true" and env["RETRIEVER_FAISS__INDEX_TYPE"] == "flat"
    assert argv[-1] == "--no-dense" and retriever.dense_missing == "build"  # in the background, BM25 serving
    waited = make_options(tmp_path, compact=DENSE_READER, dense=True, dense_background=False)  # --wait-dense
    assert "--no-dense" not in index_command(waited)[0]
    waited_specs = {s.name: s for s in build_specs(waited, redis_server=None)}
    assert load_settings("retriever", waited_specs["retriever"].env, monkeypatch).dense_missing == "refuse"
    bm25_only = {s.name: s for s in build_specs(make_options(tmp_path), redis_server=None)}
    assert not load_settings("retriever", bm25_only["retriever"].env, monkeypatch).dense
    # --dense auto: on when the served compact policy scores a dense pool
    assert _parse_args([]).dense == "auto"
    assert serve_dense("auto", DENSE_READER) and not serve_dense("auto", NAME_SEEKER)
    assert not serve_dense("auto", None) and serve_dense("on", None)
    assert not serve_dense("off", DENSE_READER)


def test_the_default_stack_starts_what_a_compact_search_needs_and_no_llm(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact policy needs no LLM: no llama.cpp, generator or judge unless asked for; the searcher is told
    which policy (the setting comes from the policy's manifest, never from the stack)."""
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.trained import COMPACT_DIR

    shipped = CompactPolicy.load(COMPACT_DIR)
    marks = tmp_path / "var" / "feedback" / "searcher.sqlite3"
    options = make_options(tmp_path, compact=shipped, dense=True, llm_services=False, feedback_db=marks)
    specs = {s.name: s for s in build_specs(options, redis_server="/usr/bin/redis-server")}
    assert list(specs) == ["redis", "retriever", "searcher"]
    env = specs["searcher"].env
    assert env["SEARCHER_POLICY_KIND"] == "compact" and env["SEARCHER_COMPACT_POLICY"] == str(COMPACT_DIR)
    assert not [k for k in env if k.startswith(("SEARCHER_POLICY__", "SEARCHER_RETRIEVE_K", "SEARCHER_MAX_TURNS",
                                                "SEARCHER_SELECT_K", "SEARCHER_LLM_SLOTS"))]
    searcher = load_settings("searcher", env, monkeypatch)
    assert searcher.policy_kind == "compact" and searcher.retrieve_k == 8  # the manifest's 30 applies to s3 only
    assert searcher.feedback == "on" and searcher.feedback_db == marks  # marks from use: in the stack's var dir
    assert missing_llm_packages(options) is None  # nothing LLM-backed to start
    # asked for: the three LLM-backed services, and a clear message where their packages are missing
    with_llm = make_options(tmp_path, compact=shipped, llm_services=True)
    assert [s.name for s in build_specs(with_llm)] == ["llm", "retriever", "generator", "judge", "searcher"]
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    assert missing_llm_packages(with_llm) == "llama-cpp-python"
    assert missing_llm_packages(make_options(tmp_path, llm_url="http://gpu:8000/v1")) is None
    args = _parse_args(["--chat", "--with-llm", "--wait-dense"])
    assert args.chat and args.with_llm and args.wait_dense


def test_chat_without_the_llm_packages_says_how_to_install_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "d1", "title": "T", "text": "x"}\n')
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    code = main(["--free-ports", "--no-color", "--no-redis", "--chat", "--corpus", str(corpus),
                       "--var-dir", str(tmp_path / "var")])
    out = capsys.readouterr().out
    assert code == 2
    assert "--chat needs the LLM-backed services" in out and "bash scripts/install.sh --llm" in out
    assert not (tmp_path / "var" / "indexes").exists()  # refused before any work
