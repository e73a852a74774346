"""The documented GPU default (vLLM serving Qwen2.5-Instruct) configured purely from env, exercised
through the fake OpenAI-compatible server: URL, model name, API key and request id reach the LLM."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from plugsearch.common.llama_server import (
    DEFAULT_MODEL_ALIAS,
    LlamaServerError,
    apply_weight_repacking,
    cpu_flags,
    llama_server_command,
    weight_repacking,
)
from plugsearch.common.llm import LLMSettings
from plugsearch.generator.api import create_app as create_generator
from plugsearch.generator.settings import GeneratorSettings
from plugsearch.judge.api import create_app as create_judge
from plugsearch.judge.settings import JudgeSettings
from tests.asgi import app_client, served_in_thread
from tests.support.fake_llm import create_fake_llm_app

VLLM_MODEL = "Qwen/Qwen2.5-14B-Instruct"


class Recording(httpx.AsyncBaseTransport):
    """Forwards to the fake server in-process and keeps every request it saw."""

    def __init__(self, reply: str) -> None:
        self.fake = create_fake_llm_app(lambda body: reply, model=VLLM_MODEL)
        self.inner = httpx.ASGITransport(app=self.fake)
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return await self.inner.handle_async_request(request)


@pytest.fixture()
def vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix in ("GENERATOR", "JUDGE"):
        monkeypatch.setenv(f"{prefix}_LLM__BASE_URL", "http://vllm-gpu:8000/v1")
        monkeypatch.setenv(f"{prefix}_LLM__MODEL", VLLM_MODEL)
        monkeypatch.setenv(f"{prefix}_LLM__API_KEY", "vllm-secret-key")
        monkeypatch.setenv(f"{prefix}_LLM__MAX_CONCURRENCY", "128")
        monkeypatch.setenv(f"{prefix}_LLM__TIMEOUT_S", "120")
    monkeypatch.setenv("GENERATOR_CONTEXT_TOKEN_BUDGET", "8000")


async def test_vllm_shaped_generator_config(vllm_env: None) -> None:
    settings = GeneratorSettings()
    assert settings.llm.model == VLLM_MODEL and settings.llm.max_concurrency == 128
    assert settings.llm.api_key is not None and settings.context_token_budget == 8000
    transport = Recording("Paris")
    async with app_client(create_generator(settings, llm_transport=transport)) as client:
        response = await client.post("/generate", json={"question": "capital?", "documents": [{"text": "Paris."}]},
                                     headers={"X-Request-ID": "trace-7"})
        assert response.status_code == 200 and response.json()["model"] == VLLM_MODEL
        assert (await client.get("/health/ready")).status_code == 200
    chat = [r for r in transport.requests if r.url.path.endswith("/chat/completions")][0]
    assert str(chat.url) == "http://vllm-gpu:8000/v1/chat/completions"
    assert chat.headers["authorization"] == "Bearer vllm-secret-key"
    assert chat.headers["x-request-id"] == "trace-7"
    assert transport.fake.state.bodies[0]["model"] == VLLM_MODEL
    assert any(r.url.path == "/v1/models" for r in transport.requests)  # readiness probes the models list


async def test_vllm_shaped_judge_config(vllm_env: None) -> None:
    transport = Recording("Yes")
    async with app_client(create_judge(JudgeSettings(), llm_transport=transport)) as client:
        response = await client.post("/judge", json={"prediction": "twenty-five", "golden_answers": ["25"]})
        assert response.json()["decided_by"] == "llm" and response.json()["score"] == 1.0
    assert str(transport.requests[0].url) == "http://vllm-gpu:8000/v1/chat/completions"
    assert transport.fake.state.bodies[0]["model"] == VLLM_MODEL


async def test_generator_calls_its_llm_over_the_production_wire() -> None:
    """No injected transport: the generator's LLM client runs its default wire (aiohttp) against the fake
    server on a real socket; the LLM's 503 reaches the caller as a 503 (the one status mapping)."""
    fake = create_fake_llm_app(lambda body: "Paris", model=VLLM_MODEL)
    with served_in_thread(fake) as url:
        llm = LLMSettings(base_url=f"{url}/v1", model=VLLM_MODEL, api_key="vllm-secret-key", max_retries=0)
        app = create_generator(GeneratorSettings(llm=llm, tokenizer_from_gguf=False))
        async with app_client(app) as client:
            answer = await client.post("/generate", json={"question": "capital?", "documents": [{"text": "Paris."}]})
            assert answer.status_code == 200 and answer.json()["answer"] == "Paris", answer.text
            assert (await client.get("/health/ready")).status_code == 200
            fake.state.fail_status = 503
            failed = await client.post("/generate", json={"question": "another?"})
            assert failed.status_code == 503 and failed.json()["error"]["type"] == "upstream_unavailable"
    assert fake.state.bodies[0]["model"] == VLLM_MODEL and fake.state.calls == 2


def test_local_default_matches_the_llama_server_alias() -> None:
    assert LLMSettings().model == DEFAULT_MODEL_ALIAS
    cmd = llama_server_command("/m.gguf", port=8080, n_threads=2, extra_args=["--n_batch", "256"])
    assert cmd[1:] == ["-m", "llama_cpp.server", "--model", "/m.gguf", "--host", "127.0.0.1", "--port", "8080",
                       "--n_ctx", "8192", "--logits_all", "false", "--interrupt_requests", "false", "--n_threads", "2",
                       "--model_alias", DEFAULT_MODEL_ALIAS, "--cache", "true", "--cache_type", "ram",
                       "--cache_size", str(512 << 20),
                       "--n_batch", "256"]


def test_prompt_cache_size_and_off() -> None:
    assert "--cache" not in llama_server_command("/m.gguf", prompt_cache_mb=0)
    cmd = llama_server_command("/m.gguf", prompt_cache_mb=64)
    assert cmd[cmd.index("--cache_size") + 1] == str(64 * 1024 * 1024)
    with pytest.raises(ValueError, match="prompt_cache_mb"):
        llama_server_command("/m.gguf", prompt_cache_mb=-1)


def test_weight_repacking_is_off_on_amx_cpus_unless_asked(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile amx_int8\n\n")
    flags = cpu_flags(cpuinfo)
    assert {"avx2", "amx_int8"} <= flags
    assert weight_repacking("auto", flags) is False
    assert weight_repacking("auto", {"avx2", "fma"}) is True
    assert weight_repacking("on", flags) is True
    assert weight_repacking("off", {"avx2"}) is False
    assert weight_repacking("", {"avx2"}) is True  # unset means auto
    assert cpu_flags(tmp_path / "missing") == set()
    with pytest.raises(LlamaServerError, match="PLUGSEARCH_LLM_REPACK"):
        weight_repacking("sometimes", flags)


def test_no_repack_clears_llama_cpp_extra_buffer_types(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = pytest.importorskip("llama_cpp.llama_cpp")
    monkeypatch.setattr(lib, "llama_model_default_params", lib.llama_model_default_params)
    assert lib.llama_model_default_params().use_extra_bufts is True
    assert apply_weight_repacking(allowed=True) is True
    assert lib.llama_model_default_params().use_extra_bufts is True
    assert apply_weight_repacking(allowed=False) is False
    assert apply_weight_repacking(allowed=False) is False  # wrapped once
    assert lib.llama_model_default_params().use_extra_bufts is False
