"""Does the corpus check's verdict hold still while documents change? 1,000 small writes on the shared corpus.

The real retriever app (bm25s + the MiniLM flat index over the shared 23,652-passage corpus, the local stack's
indexes in var/indexes/, a fresh change log in a scratch folder) in-process over ASGI, and the searcher's search
service with the shipped compact policy and its corpus check at the service's defaults (300 pseudo-questions,
re-checked past `SEARCHER_CORPUS_CHECK_RECHECK_SHARE` of the passages changed, at most once per
`SEARCHER_CORPUS_CHECK_MIN_INTERVAL_S`). After the first verdict, `--writes` small writes through `PUT /documents`
and `POST /documents/delete` (the internal token), in every 10: six new one-passage documents (real news passages
the corpus does not hold, the realtimeqa development corpus), one document of the corpus edited (a sentence added),
one deleted, one document put before replaced and one deleted. Before each write's next search the service prepares a search as `POST /search` does (which asks the
gate); the gate's clock advances `--seconds-per-write` per write (simulated: the writes themselves run faster), so
the re-check interval is exercised as if the writes came at that pace.

For contrast, at a few points (`--probes`) the check is also measured afresh on the changed corpus, as the gate
did before a verdict held still (every write moved the index identity, so each search after a write drew new
pseudo-questions): its difference, interval, the decision the old rule (mean against `-margin`) would have served,
and the decision the new rule (`settle`) keeps.

    python bench/verdict_stability.py [--writes 1000] [--seconds-per-write 1] [--probes 15,50,100,250,500,750,1000]
                                      [--dense auto|off]

Final line: {"first": {...}, "writes", "passages_changed", "share", "index_ids", "checks", "rechecks",
"decisions": {decision: searches}, "fallbacks_seen", "probes": [{"after", "difference", "interval",
"old_rule", "new_rule"}], "settings": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, load_questions, log  # noqa: E402

TOKEN = secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def news(n: int) -> list[tuple[str, str]]:
    """(title, text) of `n` real news passages (the realtimeqa development corpus: not in the shared corpus)."""
    out: list[tuple[str, str]] = []
    with (DATA / "domain" / "realtimeqa_corpus.jsonl").open() as fh:
        for line in fh:
            row = json.loads(line)
            out.append((str(row.get("title", "")), str(row["text"])))
            if len(out) >= n:
                break
    return out


EDIT = "This entry was reviewed and updated by the editors in 2024."


def corpus_documents(n: int, seed: int) -> list[tuple[str, str, str]]:
    """(id, title, text) of `n` documents of the shared corpus drawn by `seed`: the ones edited and deleted."""
    import random

    with CORPUS.open() as fh:
        rows = [json.loads(line) for line in fh]
    return [(str(r["id"]), str(r.get("title", "")), str(r["text"])) for r in random.Random(seed).sample(rows, n)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from pydantic import SecretStr

    from plugsearch.common.cache import MemoryCache, ResultCache
    from plugsearch.common.clients import RetrieverClient
    from plugsearch.common.http import ClientSettings
    from plugsearch.common.schemas.searcher import SearchRequest
    from plugsearch.retriever.api import create_app
    from plugsearch.retriever.settings import RetrieverSettings
    from plugsearch.searcher.api import sampler
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.corpus_check import CorpusGate, check_policy, settle
    from plugsearch.searcher.index_identity import IndexIdentity
    from plugsearch.searcher.pseudo_questions import check_questions
    from plugsearch.searcher.retrieval import ServiceRetriever
    from plugsearch.searcher.serving import SearchService
    from plugsearch.searcher.settings import SearcherSettings
    from plugsearch.searcher.trained import COMPACT_DIR
    from plugsearch.stack.corpus import index_dir_for
    from tests.asgi import app_client

    t0 = time.perf_counter()
    index_dir = index_dir_for(CORPUS, REPO / "var")
    with tempfile.TemporaryDirectory(prefix="verdict-") as scratch:
        settings = RetrieverSettings(corpus=CORPUS, index_dir=index_dir, bm25=True, dense=True,
                                     default_method="bm25", changes_dir=Path(scratch) / "changes",
                                     internal_token=TOKEN)
        app = create_app(settings)
        async with app_client(app) as http:
            for _ in range(6000):
                ready = await http.get("/health/ready")
                if ready.status_code == 200:
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit("the retriever did not get ready")
            log(f"retriever ready in {time.perf_counter() - t0:.0f} s")
            client = RetrieverClient(ClientSettings(url="http://retriever", token=SecretStr(TOKEN), max_retries=0,
                                                    timeout_s=120), transport=httpx.ASGITransport(app=app))
            policy = CompactPolicy.load(COMPACT_DIR)
            searcher = SearcherSettings(compact_dense=args.dense)
            clock = Clock()
            retriever = ServiceRetriever(client)
            gate = CorpusGate(policy, retriever, sampler(client), questions=searcher.corpus_check_questions,
                              margin=searcher.corpus_check_margin, manifest=policy.manifest, clock=clock,
                              recheck_share=searcher.corpus_check_recheck_share,
                              min_interval_s=searcher.corpus_check_min_interval_s)
            identity = IndexIdentity(client, ttl_s=0)
            svc = SearchService(searcher, policy=policy, retriever=retriever, index_identity=identity,
                                cache=ResultCache(MemoryCache(), name="search"), corpus_gate=gate)
            svc.start_corpus_check()
            await svc.corpus_checked()
            first = gate.last
            assert first is not None
            log(f"first verdict: {first.decision}: {first.reason} ({first.seconds:.1f} s)")
            questions = [q.question for q in load_questions("nq", 20)]
            texts = news(args.writes)
            served, encoder = await identity.served() if args.dense != "off" else (["bm25"], None)
            params = svc.params_for(SearchRequest(question="x"))
            params = params.model_copy(update={"pool_methods": policy.first_retrieval(served, encoder)})
            probes = sorted(int(p) for p in args.probes.split(",") if p)
            base = corpus_documents(args.writes // 5 + 1, seed=1)
            put: list[str] = []
            identities: set[str] = set()
            decisions: Counter[str] = Counter()
            fallbacks: set[str | None] = set()
            probed: list[dict[str, Any]] = []
            for i in range(args.writes):
                clock.now += args.seconds_per_write
                if i % 10 == 9 and put:
                    response = await http.post("/documents/delete", json={"ids": [put.pop(0)]}, headers=AUTH)
                elif i % 10 == 7:  # a document of the corpus deleted
                    response = await http.post("/documents/delete", json={"ids": [base.pop()[0]]}, headers=AUTH)
                elif i % 10 == 6:  # a document of the corpus edited: a sentence added
                    doc_id, title, text = base.pop()
                    response = await http.put("/documents", headers=AUTH, json={"documents": [
                        {"id": doc_id, "title": title, "text": f"{text} {EDIT}"}]})
                else:
                    doc = put[len(put) // 2] if i % 10 == 8 and put else f"news-{i}"
                    title, text = texts[i % len(texts)]
                    response = await http.put("/documents", headers=AUTH, json={
                        "documents": [{"id": doc, "title": title, "text": text}]})
                    if doc not in put:
                        put.append(doc)
                if response.status_code != 200:
                    raise SystemExit(f"write {i}: {response.status_code} {response.text}")
                identities.add(response.json()["index_id"])
                prepared = await svc.prepare(SearchRequest(question=questions[i % len(questions)]))
                fallbacks.add(prepared.fallback)
                await gate.settled()
                assert gate.last is not None
                decisions[gate.last.decision] += 1
                if i + 1 in probes:  # what the gate measured afresh after every write before this change
                    passages = await sampler(client)(searcher.corpus_check_questions * 2, 0)
                    made = await check_questions(passages, retriever, searcher.corpus_check_questions)
                    fresh = await check_policy(policy, params, retriever, made, margin=searcher.corpus_check_margin)
                    kept, rule = settle(first, fresh, searcher.corpus_check_margin)
                    probed.append({"after": i + 1, "difference": fresh.difference, "interval": fresh.interval,
                                   "questions": fresh.questions, "old_rule": fresh.decision, "new_rule": kept,
                                   "rule": rule})
                    log(f"after {i + 1} writes: a fresh check {fresh.difference:+.3f} {fresh.interval}: old rule "
                        f"{fresh.decision}, new rule {kept} ({rule}); the gate serves {gate.last.decision}, "
                        f"{gate.checks} check(s) so far")
                if (i + 1) % 100 == 0:
                    log(f"{i + 1} writes, {gate.checks} check(s), verdict {gate.last.decision}")
            details = (await http.get("/version")).json()["details"]
            await client.aclose()
    changes, last = details["changes"], gate.last
    assert last is not None
    return {"first": {k: first.as_dict()[k] for k in ("decision", "kind", "questions", "difference", "interval",
                                                       "policy_recall", "naive_recall", "seconds")},
            "writes": args.writes, "passages_changed": changes.get("passages"),
            "share": round(changes.get("passages", 0) / max(1, first.passages), 4), "changes": changes,
            "index_ids": len(identities), "checks": gate.checks, "rechecks": gate.rechecks,
            "decisions": dict(decisions), "fallbacks_seen": len(fallbacks),
            "last": {k: last.as_dict()[k] for k in ("decision", "rule", "difference", "interval")},
            "probes": probed,
            "settings": {"policy": policy.model, "pool": params.pool_methods,
                         "questions": searcher.corpus_check_questions, "margin": searcher.corpus_check_margin,
                         "recheck_share": searcher.corpus_check_recheck_share,
                         "min_interval_s": searcher.corpus_check_min_interval_s,
                         "seconds_per_write": args.seconds_per_write, "passages": first.passages,
                         "seconds": round(time.perf_counter() - t0, 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=1000)
    parser.add_argument("--seconds-per-write", type=float, default=1.0,
                        help="how far the gate's clock moves per write (default 1: 1,000 writes span 1,000 s)")
    parser.add_argument("--dense", choices=["auto", "off"], default="auto", help="the policy's pool: auto (BM25 + "
                        "dense, as the stack serves once its dense index is loaded) or off (BM25 alone, as while it "
                        "builds: SEARCHER_COMPACT_DENSE=off)")
    parser.add_argument("--probes", default="15,50,100,250,500,750,1000",
                        help="after these many writes, also measure the check afresh (the old behaviour)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
