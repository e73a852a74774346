"""Locating the packaged SmolLM2 GGUF and starting llama.cpp's server (failure paths; the happy path is
the session `llama_url` fixture used by the e2e tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugsearch.common.llama_server import (
    GGUF_ENV,
    SMOLLM2_GGUF,
    LlamaServer,
    LlamaServerError,
    smollm2_gguf_path,
)


def test_packaged_gguf_is_found_without_download(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GGUF_ENV, raising=False)
    path = smollm2_gguf_path()
    assert path.name == SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    monkeypatch.setenv(GGUF_ENV, str(other))
    assert smollm2_gguf_path() == other
    monkeypatch.setenv(GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(LlamaServerError, match="missing.gguf"):
        smollm2_gguf_path()


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is not a GGUF file")
    server = LlamaServer(bogus, n_threads=1, startup_timeout_s=60, log_path=tmp_path / "llama.log")
    with pytest.raises(LlamaServerError, match="exited"):
        server.start()
    assert server.process is None  # stopped and cleaned up
    assert (tmp_path / "llama.log").stat().st_size > 0
