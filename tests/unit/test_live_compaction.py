"""Compaction and the work per change, on a real tiny corpus (bm25s + MiniLM flat): the changes folded into new
index files that every worker swaps in at its next poll, the built corpus's identity kept (its checksum, the changes
counted since it) while the index id moves; a restart replays only the changes after the fold; a search answered
from the generation before is still read right; the passages put while the dense index was not there are encoded
once, in batches, off the caller's thread, and never again by a restart; a change costs its own passages, never a
copy of what came before."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import ChangeLog
from plugsearch.retriever.live.compaction import compact
from plugsearch.retriever.serving import RetrieverService, change_log_folder, check_indexes
from plugsearch.retriever.settings import RetrieverSettings
from tests.support.retriever import ensure_tiny_indexes, tiny_bm25s, tiny_settings


def passage(doc: str, n: int, text: str, title: str = "") -> Passage:
    return Passage(id=f"{doc}#{n}", doc_id=doc, title=title, text=text)


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    corpus, index_dir = tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("compaction"))
    ensure_tiny_indexes(tiny_settings(corpus, index_dir), bm25=["bm25s"], dense=True)
    return corpus, index_dir


def settings_of(tiny: tuple[Path, Path], changes: Path, **overrides: object) -> RetrieverSettings:
    return tiny_settings(*tiny, changes_dir=changes, **overrides)


def load(settings: RetrieverSettings) -> RetrieverService:
    return RetrieverService.load(settings, check_indexes(settings))


def top(svc: RetrieverService, query: str, method: str = "bm25", k: int = 5) -> list[str]:
    async def run() -> list[str]:
        _, hits = await svc.search([query], k, method)
        return [d for d, _, _ in svc.corpus.documents([int(i) for i in hits.ids[0] if i >= 0])]

    return asyncio.run(run())


def test_compaction_folds_the_changes_into_new_indexes_and_keeps_the_corpus_identity(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    settings = settings_of(tiny, tmp_path / "changes")
    svc = load(settings)
    live = svc.live
    assert live is not None
    built_checksum, base_id = svc.corpus.checksum, svc.index_id
    victim = top(svc, "Big Stone Gap", k=1)[0]
    live.write([passage("orchid-note", 0, "Orchids bloom in humid greenhouses every spring", "Greenhouse orchids"),
                passage("orchid-note", 1, "The velzarine orchid wants bright shade")], [])
    live.write([], [victim])
    live.write([passage("memo", 0, "An old memo about quorvexian pumps")], [])
    live.write([passage("memo", 0, "The memo now speaks of brintel rollouts")], [])  # replaced whole
    before = {q: top(svc, q) for q in ("velzarine orchid", "brintel rollouts", "Big Stone Gap")}
    old_hits = asyncio.run(svc.search(["velzarine orchid"], 3, "bm25"))[1]
    changed, seq, ids = dict(live.state.changed), live.seq, {base_id, svc.index_id}
    assert live.state.overlay_passages == 5  # 4 passages put, 1 base passage left out

    folder = change_log_folder(settings, built_checksum)
    generation = compact(settings, folder, built_checksum)
    assert generation is not None and generation.gen == 1 and generation.folded == seq
    assert live.generation == 0  # nothing changes for a worker until its next poll
    live.poll()
    assert live.generation == 1 and live.state.overlay_passages == 0 and live.seq == seq
    assert live.state.changed == changed and svc.corpus.checksum == built_checksum  # the built corpus's identity
    assert svc.index_id not in ids
    after = {q: top(svc, q) for q in before}
    assert after["velzarine orchid"][0] == "orchid-note#1" and after["brintel rollouts"][0] == "memo#0"
    assert victim not in after["Big Stone Gap"] and "memo#0" not in top(svc, "quorvexian pumps")
    assert top(svc, "when do greenhouse orchids flower", "dense", 1) == ["orchid-note#0"]
    assert top(svc, "when do greenhouse orchids flower", "hybrid", 1) == ["orchid-note#0"]
    # a search answered from generation 0 just before the swap is still read right
    assert svc.corpus.documents([int(old_hits.ids[0][0])])[0][0] == "orchid-note#1"
    # the generation's files are the owner's alone
    gen_folder = folder / str(generation.body["folder"])
    assert all((p.stat().st_mode & 0o777) == (0o700 if p.is_dir() else 0o600) for p in gen_folder.rglob("*"))

    live.write([passage("late-note", 0, "A kaporite sample reached the lab late")], [])
    restarted = load(settings)
    assert restarted.live is not None and restarted.live.generation == 1
    assert restarted.live.state.size == 1  # only the change after the fold is replayed
    assert top(restarted, "kaporite sample", k=1) == ["late-note#0"]
    assert top(restarted, "velzarine orchid", k=1) == ["orchid-note#1"]
    assert restarted.index_id == svc.index_id

    second = compact(settings, folder, built_checksum)
    assert second is not None and second.gen == 2
    log = ChangeLog(folder)
    assert log.pruned == seq and [c.seq for c in log.read_after(seq)] == [seq + 1]  # the first fold's records gone
    restarted.live.poll()
    assert restarted.live.generation == 2 and top(restarted, "kaporite sample", k=1) == ["late-note#0"]
    assert sorted(p.name for p in (folder / "generations").iterdir()) == ["g000001", "g000002"]
    assert compact(settings, folder, built_checksum) is None  # nothing left to fold
    svc.live.close()
    restarted.live.close()


def test_a_change_costs_its_own_passages_not_a_copy_of_the_postings(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    svc = load(settings_of(tiny, tmp_path, dense=False))
    live = svc.live
    assert live is not None
    live.write([passage(f"bulk-{i}", 0, f"shared plinthorax words and term{i}") for i in range(200)], [])
    postings = live.view.postings
    assert postings is not None
    held = postings.terms["plinthorax"][0]
    others = {t: v[0] for t, v in postings.terms.items() if t != "zebulon"}
    live.write([passage("zeb", 0, "zebulon only")], [])
    assert postings.terms["plinthorax"][0] is held  # untouched terms: the same arrays, nothing copied
    assert all(postings.terms[t][0] is a for t, a in others.items())
    assert top(svc, "plinthorax term7", k=1) == ["bulk-7#0"] and top(svc, "zebulon", k=1) == ["zeb#0"]


def test_passages_put_before_the_dense_index_are_encoded_once_in_batches_off_the_callers_thread(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A worker without the dense index logs its puts without vectors; the one that has it encodes them in a thread,
    logs them beside their changes, and a restart reads them instead of encoding them again."""
    import threading

    from plugsearch.retriever.live import vectors as live_vectors

    bm25_only = load(settings_of(tiny, tmp_path, dense=False))
    assert bm25_only.live is not None
    bm25_only.live.write([passage(f"note-{i}", 0, f"Greenhouse note {i}: orchids need humid air and shade")
                          for i in range(150)], [])
    encoded_in: set[str] = set()
    real = live_vectors.CatchUp.run

    def spy(self: live_vectors.CatchUp) -> None:
        encoded_in.add(threading.current_thread().name)
        real(self)

    live_vectors.CatchUp.run = spy  # type: ignore[method-assign]
    try:
        dense = load(settings_of(tiny, tmp_path))
        assert dense.live is not None
        assert top(dense, "greenhouse orchids humid", "bm25", 1)[0].startswith("note-")  # BM25 finds them at once
        for _ in range(1200):
            if dense.live.pending_vectors() == 0:
                break
            time.sleep(0.05)
        assert dense.live.pending_vectors() == 0 and encoded_in == {"dense-catch-up"}
        assert dense.live._catch_up is not None and dense.live._catch_up.encoded == 150
        log = ChangeLog(dense.live.log.folder)  # type: ignore[union-attr]
        parts = log.vectors_for(1)
        assert sum(len(p.array) for p in parts) == 150 and max(len(p.array) for p in parts) <= 64
        again = load(settings_of(tiny, tmp_path))
        assert again.live is not None and again.live.pending_vectors() == 0 and again.live._catch_up is None
        assert top(again, "when do greenhouse orchids flower", "dense", 1)[0].startswith("note-")
    finally:
        live_vectors.CatchUp.run = real  # type: ignore[method-assign]
