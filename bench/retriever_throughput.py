"""Retriever throughput: the served process against the fastest in-process library call, same run.

Per method (bm25 = bm25s, dense = MiniLM + FAISS flat, hybrid = RRF of both): queries/s of `POST /retrieve`
(k=10, 8 clients) at batch 1, 32 and 256 next to one in-process caller of the same library objects, in
interleaved windows so both see the same machine load; `ratio_b32` = service / in-process at batch 32 (above 1
when the micro-batcher merges the clients' requests); the service's peak RSS (VmHWM, summed over `--workers`
and `--replicas`).

The default dense path against torch (`vs_torch`): for dense and hybrid, the served default (no encoder
setting: ONNX Runtime fp32) against plain in-process torch in the same windows: sentence-transformers'
`encode` of the batch (its defaults) + the FAISS search, which is what Search-R1's `retrieval_server.py` does
per request (hybrid: bm25s + that + RRF). `ratio` = served / torch; recall@10 and identical top-10 lists
(same ids in the same order up to swaps of neighbours whose scores tie within 1e-5, scores within 1e-5) of
the served results against torch's, on `--recall-questions` real questions. Also reported: torch the way
Search-R1's server calls it (one forward of the whole batch padded to its longest question, no length
sorting: `searchr1_encode_qps` and `ratio_searchr1_encode`, dense only), and the encoders' CPU time per
query on one thread each (`encoder_cpu_one_thread`: thread CPU time, which other load on the machine barely
moves, unlike the wall-clock rates of multi-threaded torch; a note says when the machine was loaded).

Encoder backends: dense queries/s of onnx and onnx-int8 against torch (in-process and served) and recall@10
against torch's top-10. ANN: HNSW and SQ8 / IVF-PQ against exact search on synthetic vectors (around real
MiniLM passage vectors when the dense index exists): recall@10 and speed-up.

The encoder's query-vector cache (`RETRIEVER_ENCODER__QUERY_CACHE`) is off in every measurement here: the
question pool repeats, and what is measured is the encoder.

Dense figures use the full corpus's MiniLM flat index, built once into var/indexes/combined when missing
(~4 min on 2 cores with the ONNX encoder, 10-20 with torch); `--quick` never builds it and uses a ~300-passage subset instead (a note says so).

    python bench/retriever_throughput.py           # 8 s per point, 1,000,000 vectors
    python bench/retriever_throughput.py --quick   # 0.5 s per point, 20,000 128-d vectors (says so)
    python bench/retriever_throughput.py --methods dense,hybrid --skip-ann --skip-onnx   # vs torch only

The client is a minimal keep-alive HTTP/1.1 client on asyncio streams, so that it takes little CPU from the
server. The last line printed is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, REPO, load_questions, log  # noqa: E402
from bench.retriever_common import (  # noqa: E402
    DATASETS,
    INDEX_DIR,
    ServedRetriever,
    dense_available,
    dense_subset,
    ensure_indexes,
)
from plugsearch.retriever.backends.base import Hits, Retriever  # noqa: E402

BATCHES = (1, 32, 256)
ONNX_BATCHES = (1, 32)
BACKENDS = ("torch", "onnx", "onnx-int8")
ONNX_DIR = REPO / "var" / "cache" / "onnx"  # the setting's default (relative to the service's working dir)
CLIENTS = 8
ROUNDS = 2
REFUSED: Counter[str] = Counter()
"""429s (with Retry-After) the service answered in measured windows, per method: the clients back off as
told, so a refused request costs its client the wait and counts in no figure."""
K = 10


class RawClient:
    """One keep-alive connection; POST JSON, read the full body (Content-Length)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, float]:
        """(status, body, Retry-After seconds or 0)."""
        try:
            return await self._post(path, body)
        except (asyncio.IncompleteReadError, ConnectionError):
            # the server closes keep-alive connections idle for > 5 s (uvicorn's default): reconnect once
            await self.close()
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes, float]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        header = await self.reader.readuntil(b"\r\n\r\n")
        status = int(header[9:12])
        length, retry_after = 0, 0.0
        for line in header.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
            elif line[:12].lower() == b"retry-after:":
                retry_after = float(line[12:])
        return status, await self.reader.readexactly(length), retry_after

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with suppress(ConnectionError):
                await self.writer.wait_closed()
            self.reader = self.writer = None


async def _service_rate(ports: list[int], method: str, batch: int, pool: list[str], seconds: float) -> float:
    bodies = [orjson.dumps({"queries": pool[i:i + batch], "k": K, "method": method})
              for i in range(0, len(pool) - batch, max(batch, 7))][:200]
    clients = [RawClient(ports[i % len(ports)]) for i in range(CLIENTS)]  # spread over the replicas
    done = refused = 0
    checked = False

    async def worker(c: RawClient, offset: int) -> None:
        nonlocal done, checked, refused
        for body in itertools.islice(itertools.cycle(bodies), offset, None):
            if time.perf_counter() >= stop:
                return
            status, payload, retry_after = await c.post("/retrieve", body)
            if status == 429 and retry_after:  # shed by the adaptive admission limit: back off as told
                refused += 1
                await asyncio.sleep(min(retry_after, max(0.0, stop - time.perf_counter())))
                continue
            if status != 200:
                raise RuntimeError(f"service answered {status}: {payload[:300]!r}")
            if not checked:
                parsed = orjson.loads(payload)
                if len(parsed["results"]) != batch or len(parsed["results"][0]) != K:
                    raise RuntimeError("service returned the wrong number of results")
                checked = True
            done += batch

    # warm-up (connections, first micro-batches), then the measured window
    stop = time.perf_counter() + min(1.0, seconds / 2)
    await asyncio.gather(*(worker(c, i * 3) for i, c in enumerate(clients)))
    done = refused = 0
    t0 = time.perf_counter()
    stop = t0 + seconds
    await asyncio.gather(*(worker(c, i * 5) for i, c in enumerate(clients)))
    rate = done / (time.perf_counter() - t0)
    REFUSED[method] += refused
    for c in clients:
        await c.close()
    return rate


def _inprocess_rate(retriever: Any, batch: int, pool: list[str], seconds: float) -> float:
    batches = [pool[i:i + batch] for i in range(0, len(pool) - batch, max(batch, 7))][:200]
    retriever.batch_search(batches[0], K)  # warm
    done = 0
    t0 = time.perf_counter()
    for queries in itertools.cycle(batches):
        retriever.batch_search(queries, K)
        done += len(queries)
        if time.perf_counter() - t0 >= seconds:
            break
    return done / (time.perf_counter() - t0)


def ann_vs_exact(n: int, n_queries: int = 1000, dims: int = 384) -> dict[str, Any]:
    import faiss

    from plugsearch.retriever.backends.faiss_index import configure_search, new_faiss_index
    from plugsearch.retriever.settings import FaissSettings
    from plugsearch.retriever.store.chunks import iter_chunks

    rng = np.random.default_rng(0)
    emb = sorted(INDEX_DIR.glob("embeddings-*/manifest.json"))
    if emb and dims == 384:
        centres = np.concatenate([np.asarray(c) for c in iter_chunks(emb[0].parent)])
        source = f"real MiniLM passage vectors ({len(centres)}) + gaussian noise"
    else:
        centres = rng.standard_normal((2000, dims)).astype(np.float32)
        source = f"2,000 random {dims}-d centres + gaussian noise"
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def sample(m: int) -> np.ndarray:
        x = centres[rng.integers(0, len(centres), m)] + rng.standard_normal((m, dims)).astype(np.float32) * 0.04
        return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)

    t0 = time.perf_counter()
    xb = np.concatenate([sample(min(100_000, n - i)) for i in range(0, n, 100_000)])
    xq = sample(n_queries)
    log(f"ann: {n} vectors synthesised in {time.perf_counter() - t0:.1f} s ({source})")

    def timed_search(index: Any) -> tuple[np.ndarray, float]:
        index.search(xq[:50], K)
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            _, ids = index.search(xq, K)
            best = min(best, time.perf_counter() - t)
        return ids, best

    flat = faiss.IndexFlatIP(dims)
    flat.add(xb)
    truth, t_flat = timed_search(flat)
    del flat
    out: dict[str, Any] = {"vectors": n, "queries": n_queries, "dims": dims, "data": source,
                           "flat_search_s": round(t_flat, 4)}
    configs = {"hnsw": FaissSettings(index_type="hnsw", hnsw_m=32, hnsw_ef_construction=64, hnsw_ef_search=128),
               "sq8": FaissSettings(index_type="sq8"),
               "ivfpq": FaissSettings(index_type="ivfpq", ivf_nlist=1024 if n >= 500_000 else 256, pq_m=dims // 8,
                                      nprobe=32)}
    for name, fs in configs.items():
        t = time.perf_counter()
        index = new_faiss_index(dims, n, fs)
        if not index.is_trained:
            index.train(xb[rng.choice(n, min(n, 100_000), replace=False)])
        for i in range(0, n, 100_000):
            index.add(xb[i:i + 100_000])
        build = time.perf_counter() - t
        configure_search(index, fs)
        ids, t_search = timed_search(index)
        recall = float(np.mean([len(set(ids[q]) & set(truth[q])) / K for q in range(n_queries)]))
        out[name] = {"recall_at_10": round(recall, 4), "speedup": round(t_flat / t_search, 2),
                     "build_s": round(build, 1), "search_s": round(t_search, 4),
                     "params": fs.model_dump(include={"hnsw_m", "hnsw_ef_construction", "hnsw_ef_search",
                                                      "ivf_nlist", "pq_m", "nprobe"})}
        log(f"ann: {name}: {out[name]}")
        del index
    return out


def recall_questions(n: int) -> list[str]:
    """n real questions, taken round-robin from the question sets (not the pool's first set only)."""
    sets = [[r.question for r in load_questions(name, limit=n)] for name in DATASETS]
    return [q for row in itertools.zip_longest(*sets) for q in row if q][:n]


class TorchDense(Retriever):
    """Plain in-process torch: sentence-transformers' `encode` of the batch with its defaults (batches of 32
    sorted by length), normalised, then one FAISS search: Search-R1's `retrieval_server.py` per request.
    `whole_batch`: the way that server calls its model (the batch tokenized at once, padded to its longest,
    one forward, mean pooling, normalised)."""

    name = "dense"

    def __init__(self, index: Any, *, whole_batch: bool = False) -> None:
        import torch
        from sentence_transformers import SentenceTransformer
        from transformers import AutoModel, AutoTokenizer

        from plugsearch.retriever.encoders.encoder import resolve_encoder_path
        from plugsearch.retriever.settings import DEFAULT_ENCODER

        path = resolve_encoder_path(DEFAULT_ENCODER)
        self.torch = torch
        self.index = index
        self.whole_batch = whole_batch
        if whole_batch:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).eval()
        else:
            self.st = SentenceTransformer(path, device="cpu")

    @property
    def doc_count(self) -> int:
        return int(self.index.ntotal)

    def encode(self, queries: list[str]) -> np.ndarray:
        if not self.whole_batch:
            return np.asarray(self.st.encode(queries, normalize_embeddings=True, convert_to_numpy=True),
                              dtype=np.float32)
        inputs = self.tokenizer(queries, max_length=256, padding=True, truncation=True, return_tensors="pt")
        with self.torch.no_grad():
            hidden = self.model(**inputs).last_hidden_state
        mask = inputs["attention_mask"][..., None]
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
        return np.ascontiguousarray(self.torch.nn.functional.normalize(pooled, dim=-1).numpy(), dtype=np.float32)

    def batch_search(self, queries: Any, k: int) -> Hits:
        hits: Hits = self.index.search(self.encode(list(queries)), k)
        return hits

    def close(self) -> None:
        pass


def same_top10(ids: np.ndarray, scores: np.ndarray, ref_ids: np.ndarray, ref_scores: np.ndarray,
               score_tolerance: float | None) -> np.ndarray:
    """Per query: the same ids in the same order, where neighbours whose reference scores tie within 1e-5 may
    swap, and (score_tolerance set) every score within it of the reference's."""
    out = np.zeros(len(ids), dtype=bool)
    ties = np.abs(np.diff(ref_scores, axis=1)) < 1e-5
    for q in range(len(ids)):
        if set(ids[q]) != set(ref_ids[q]):
            continue
        moved = np.flatnonzero(ids[q] != ref_ids[q])
        if not all((r > 0 and ties[q, r - 1]) or (r < ids.shape[1] - 1 and ties[q, r]) for r in moved):
            continue
        out[q] = score_tolerance is None or bool(np.abs(scores[q] - ref_scores[q]).max() <= score_tolerance)
    return out


async def _served_hits(port: int, method: str, questions: list[str], corpus_ids: dict[str, int]
                       ) -> tuple[np.ndarray, np.ndarray]:
    client = RawClient(port)
    ids, scores = [], []
    for lo in range(0, len(questions), 32):
        status, body, _ = await client.post("/retrieve", orjson.dumps({"queries": questions[lo:lo + 32], "k": K,
                                                                       "method": method}))
        if status != 200:
            raise RuntimeError(f"service answered {status}: {body[:300]!r}")
        for ranked in orjson.loads(body)["results"]:
            ids.append([corpus_ids[d["id"]] for d in ranked])
            scores.append([d["score"] for d in ranked])
    await client.close()
    return np.asarray(ids, dtype=np.int64), np.asarray(scores, dtype=np.float32)


def served_vs_torch(port: int, baselines: dict[str, Any], corpus_ids: dict[str, int], questions: list[str]
                    ) -> dict[str, dict[str, float]]:
    """recall@10 and identical top-10 lists of the served methods against the in-process torch baselines."""
    out: dict[str, dict[str, float]] = {}
    for method, baseline in baselines.items():
        truth = baseline.batch_search(questions, K)
        ids, scores = asyncio.run(_served_hits(port, method, questions, corpus_ids))
        recall = float(np.mean([len(set(ids[i]) & set(truth.ids[i])) / K for i in range(len(questions))]))
        # hybrid scores are RRF of ranks: equal ranks give equal scores, compared as such
        same = same_top10(ids, scores, truth.ids, truth.scores, 1e-5)
        out[method] = {"recall_at_10": round(recall, 4), "identical_top10": round(float(same.mean()), 4),
                       "max_score_difference": float(np.abs(scores - truth.scores).max())}
    return out


def encoder_cpu_per_query(index: Any, pool: list[str], queries: int = 1024) -> dict[str, Any]:
    """CPU milliseconds per query of the encoders alone, on one thread each (thread CPU time, which other load on
    the machine barely moves, unlike wall-clock rates of multi-threaded torch): sentence-transformers' encode
    (its defaults), Search-R1's one padded forward per batch, and the default ONNX Runtime encoder; the same
    batches (consecutive questions of the pool, spread over all of it)."""
    import torch

    from plugsearch.retriever.encoders.encoder import Encoder
    from plugsearch.retriever.settings import EncoderSettings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        onnx = Encoder(EncoderSettings(threads=1, onnx_dir=ONNX_DIR, query_cache=0))
        if onnx.onnx is None:
            return {"skipped": f"the default backend serves torch here: {onnx.fallback}"}
        encoders = {"torch": TorchDense(index).encode, "searchr1_encode": TorchDense(index, whole_batch=True).encode,
                    "onnx": onnx.encode_queries}
        out: dict[str, Any] = {}
        for batch in (32, 256):
            starts = np.linspace(0, len(pool) - batch, max(2, queries // batch)).astype(int)
            batches = [pool[s:s + batch] for s in starts]
            ms: dict[str, float] = {}
            for name, encode in encoders.items():
                encode(batches[0])  # warm
                t0 = time.thread_time()
                for queries_ in batches:
                    encode(queries_)
                ms[name] = round((time.thread_time() - t0) / sum(map(len, batches)) * 1e3, 3)
            out[str(batch)] = {"ms_per_query": ms, "torch_over_onnx": round(ms["torch"] / ms["onnx"], 2),
                               "searchr1_encode_over_onnx": round(ms["searchr1_encode"] / ms["onnx"], 2)}
        onnx.onnx.close()
        return out
    finally:
        torch.set_num_threads(threads)


def encoder_backends(corpus: Path, index_dir: Path, pool: list[str], seconds: float, n_questions: int,
                     served: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """Dense queries/s per encoder backend (in-process and served, batch 1 and 32) and recall@10 vs torch.
    `served`: the backends also measured behind a service (one process each, started together)."""
    from plugsearch.retriever.backends.dense import DenseRetriever
    from plugsearch.retriever.backends.faiss_index import FaissIndex
    from plugsearch.retriever.encoders.encoder import Encoder
    from plugsearch.retriever.settings import EncoderSettings, FaissSettings

    index = FaissIndex(index_dir / "dense-flat", FaissSettings())
    retrievers = {b: DenseRetriever(Encoder(EncoderSettings(backend=b, onnx_dir=ONNX_DIR, query_cache=0)), index)
                  for b in BACKENDS}  # an onnx backend's first use exports the model (once, logged)
    questions = recall_questions(n_questions)
    truth = retrievers["torch"].batch_search(questions, K).ids
    recall: dict[str, float] = {}
    same_top10: dict[str, float] = {}
    for b in BACKENDS[1:]:
        ids = retrievers[b].batch_search(questions, K).ids
        recall[b] = round(float(np.mean([len(set(ids[i]) & set(truth[i])) / K for i in range(len(questions))])), 4)
        same_top10[b] = round(float(np.mean((ids == truth).all(axis=1))), 4)
    log(f"encoder backends: recall@10 vs torch {recall}, identical top-10 lists {same_top10}")

    inprocess: dict[str, dict[str, float]] = {b: {} for b in BACKENDS}
    service: dict[str, dict[str, float]] = {b: {} for b in served}

    def start(backend: str) -> ServedRetriever:
        return ServedRetriever({"RETRIEVER_DENSE": "true", "RETRIEVER_DEFAULT_METHOD": "dense", "RETRIEVER_WORKERS": "1",
                                "RETRIEVER_ENCODER__BACKEND": backend, "RETRIEVER_ENCODER__ONNX_DIR": str(ONNX_DIR)},
                               corpus=corpus, index_dir=index_dir)

    with ExitStack() as stack, ThreadPoolExecutor(len(served)) as starter:
        starting = {b: starter.submit(start, b) for b in served}
        ports = {b: stack.enter_context(f.result()).port for b, f in starting.items()}
        for batch in ONNX_BATCHES:
            ip: dict[str, list[float]] = {b: [] for b in BACKENDS}
            sv: dict[str, list[float]] = {b: [] for b in BACKENDS}
            for _ in range(ROUNDS):  # interleaved: every backend sees the same machine load
                for b in BACKENDS:
                    ip[b].append(_inprocess_rate(retrievers[b], batch, pool, seconds / ROUNDS))
                    if b in ports:
                        sv[b].append(asyncio.run(_service_rate([ports[b]], "dense", batch, pool, seconds / ROUNDS)))
            for b in BACKENDS:
                inprocess[b][str(batch)] = round(sum(ip[b]) / ROUNDS, 1)
                if b in ports:
                    service[b][str(batch)] = round(sum(sv[b]) / ROUNDS, 1)
            log(f"encoder backends at batch {batch}: in-process "
                f"{ {b: inprocess[b][str(batch)] for b in BACKENDS} }, served { {b: service[b][str(batch)] for b in served} }")
    speedup = {b: {where: {str(batch): round(rates[b][str(batch)] / rates["torch"][str(batch)], 2)
                           for batch in ONNX_BATCHES}
                   for where, rates in (("inprocess", inprocess), ("service", service)) if b in rates}
               for b in BACKENDS[1:]}
    return {"inprocess_qps": inprocess, "service_qps": service, "speedup_vs_torch": speedup,
            "recall_at_10_vs_torch": recall, "identical_top10_vs_torch": same_top10,
            "recall_questions": len(questions), "index_documents": index.ntotal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, 20k vectors")
    parser.add_argument("--seconds", type=float, default=None, help="measured window per point")
    parser.add_argument("--vectors", type=int, default=None, help="ANN benchmark size")
    parser.add_argument("--methods", default="bm25,dense,hybrid")
    parser.add_argument("--dims", type=int, default=None, help="ANN vector size (default 384 = MiniLM; "
                        "--quick: 128)")
    parser.add_argument("--skip-ann", action="store_true")
    parser.add_argument("--skip-onnx", action="store_true", help="no encoder backend comparison")
    parser.add_argument("--recall-questions", type=int, default=None, help="questions for recall@10 against torch "
                        "(the served default, and the onnx backends; default 300; --quick: 100)")
    parser.add_argument("--build-backend", choices=["auto", "torch", "onnx"], default="auto",
                        help="encoder backend that builds the full-corpus dense index when it is missing")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("RETRIEVER_WORKERS", "1")),
                        help="service worker processes (RETRIEVER_WORKERS; default 1)")
    parser.add_argument("--replicas", type=int, default=1, help="service processes behind the same clients "
                        "(like replicas on one node; peak RSS is their sum)")
    args = parser.parse_args()
    seconds = args.seconds or (0.5 if args.quick else 8.0)
    dims = args.dims or (128 if args.quick else 384)
    n_vectors = args.vectors or (20_000 if args.quick else 1_000_000)

    from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever
    from plugsearch.retriever.backends.dense import DenseRetriever
    from plugsearch.retriever.backends.faiss_index import FaissIndex
    from plugsearch.retriever.backends.fusion import HybridRetriever
    from plugsearch.retriever.encoders.encoder import Encoder
    from plugsearch.retriever.settings import EncoderSettings, FaissSettings, RetrieverSettings
    from plugsearch.retriever.store.corpus import Corpus

    methods = [m for m in args.methods.split(",") if m]
    wants_dense = any(m in ("dense", "hybrid") for m in methods) or not args.skip_onnx
    # the full corpus's dense index: built once (cached in var/) by a full run; --quick only reuses it
    build_dense = wants_dense and not args.quick and not dense_available()
    if build_dense:
        log(f"building the MiniLM flat index over the full corpus once ({args.build_backend} encoder; ~4 min on "
            f"2 cores with ONNX, 10-20 with torch), cached in {INDEX_DIR}")
        os.environ["RETRIEVER_ENCODER__BACKEND"] = args.build_backend  # read by the build's settings only
        os.environ["RETRIEVER_ENCODER__ONNX_DIR"] = str(ONNX_DIR)
    ensure_indexes(bm25=["bm25s"], dense=build_dense)
    load = os.getloadavg()[0]  # other work on the machine, before this run's own processes start
    os.environ.pop("RETRIEVER_ENCODER__BACKEND", None)  # the services below set their own
    notes: list[str] = []
    pool = [r.question for name in DATASETS for r in load_questions(name)]
    defaults = RetrieverSettings(bm25=True)
    # (methods, corpus, index dir): bm25 always over the combined corpus; dense/hybrid over it when its
    # dense index exists, else over a small subset (query encoding dominates their cost either way)
    setups: list[tuple[list[str], Path, Path]] = [([m for m in methods if m == "bm25"], CORPUS, INDEX_DIR)]
    dense_methods = [m for m in methods if m in ("dense", "hybrid")]
    dense_corpus, dense_index_dir = CORPUS, INDEX_DIR
    if wants_dense and not dense_available():  # --quick without the full index: a small subset stands in
        dense_corpus, dense_index_dir = dense_subset()
        notes.append(f"dense figures (methods {'/'.join(dense_methods) or '-'}, encoder backends) over a "
                     f"{sum(1 for _ in dense_corpus.open())}-passage subset ({dense_corpus.name}): no dense index "
                     f"for the full corpus in {INDEX_DIR} (a full run builds it)")
        log(notes[-1])
    if dense_methods:
        if dense_corpus == CORPUS:
            setups[0][0].extend(dense_methods)
        else:
            setups.append((dense_methods, dense_corpus, dense_index_dir))

    inprocess: dict[str, dict[str, float]] = {}
    service: dict[str, dict[str, float]] = {}
    vs_torch: dict[str, Any] = {}
    peaks = []
    n_questions = args.recall_questions or (100 if args.quick else 300)
    for names, corpus, index_dir in setups:
        if not names:
            continue
        # the fastest single in-process caller, with the service's classes and parameters but a scorer thread
        # per core (not the service's setting, which --replicas runs may lower)
        bm25 = Bm25sRetriever(index_dir / "bm25s", threads=os.cpu_count() or 2)
        candidates: dict[str, Any] = {"bm25": bm25}
        baselines: dict[str, Any] = {}  # plain torch, per dense method
        uses_dense = any(m in ("dense", "hybrid") for m in names)
        if uses_dense:
            index = FaissIndex(index_dir / "dense-flat", FaissSettings())
            dense = DenseRetriever(Encoder(EncoderSettings(query_cache=0)), index)  # the default backend, as served
            candidates["dense"] = dense
            candidates["hybrid"] = HybridRetriever(bm25, dense, depth=defaults.fusion_depth, rrf_k=defaults.rrf_k)
            torch_dense = TorchDense(index)
            baselines["dense"] = torch_dense
            baselines["hybrid"] = HybridRetriever(bm25, torch_dense, depth=defaults.fusion_depth,
                                                  rrf_k=defaults.rrf_k)
            whole_batch = TorchDense(index, whole_batch=True)
        env = {"RETRIEVER_DENSE": "true" if uses_dense else "false", "RETRIEVER_WORKERS": str(args.workers)}
        with ExitStack() as replicas:
            t0 = time.perf_counter()
            served_all = [replicas.enter_context(ServedRetriever(env, corpus=corpus, index_dir=index_dir))
                          for _ in range(args.replicas)]
            ports = [served.port for served in served_all]
            log(f"service ready in {time.perf_counter() - t0:.1f} s (a first start exports the encoder to ONNX)")
            if uses_dense:
                served_details = orjson.loads(urlopen(f"{served_all[0].url}/version", timeout=10).read())["details"]
                vs_torch["served_encoder_backend"] = served_details["encoder_backend"]
                vs_torch["served_encoder_fallback"] = served_details["encoder_fallback"]
            for method in names:
                inprocess[method], service[method] = {}, {}
                baseline = baselines.get(method)
                if baseline is not None:
                    vs_torch[method] = {"service_qps": service[method], "torch_qps": {}, "ratio": {}}
                    if method == "dense":
                        vs_torch[method]["searchr1_encode_qps"] = {}
                for b in BATCHES:
                    ip, sv, tq, wb = [], [], [], []
                    for _ in range(ROUNDS):  # interleaved: all see the same machine load
                        ip.append(_inprocess_rate(candidates[method], b, pool, seconds / ROUNDS))
                        if baseline is not None:
                            tq.append(_inprocess_rate(baseline, b, pool, seconds / ROUNDS))
                        if method == "dense":
                            wb.append(_inprocess_rate(whole_batch, b, pool, seconds / ROUNDS))
                        sv.append(asyncio.run(_service_rate(ports, method, b, pool, seconds / ROUNDS)))
                    inprocess[method][str(b)] = round(sum(ip) / ROUNDS, 1)
                    service[method][str(b)] = round(sum(sv) / ROUNDS, 1)
                    if baseline is not None:
                        vs_torch[method]["torch_qps"][str(b)] = round(sum(tq) / ROUNDS, 1)
                        vs_torch[method]["ratio"][str(b)] = round(sum(sv) / sum(tq), 2)
                    if wb:
                        vs_torch[method]["searchr1_encode_qps"][str(b)] = round(sum(wb) / ROUNDS, 1)
                        vs_torch[method].setdefault("ratio_searchr1_encode", {})[str(b)] = round(sum(sv) / sum(wb), 2)
                log(f"in-process {method}: {inprocess[method]}")
                log(f"service    {method}: {service[method]}")
                if baseline is not None:
                    log(f"torch      {method}: {vs_torch[method]['torch_qps']}, served / torch "
                        f"{vs_torch[method]['ratio']}")
                if method == "dense" and baseline is not None:
                    log(f"torch, Search-R1's way (one padded forward per batch): "
                        f"{vs_torch[method]['searchr1_encode_qps']}, served / that "
                        f"{vs_torch[method]['ratio_searchr1_encode']}")
            if baselines:
                vs_torch["encoder_cpu_one_thread"] = encoder_cpu_per_query(index, pool)
                log(f"encoders' CPU per query, one thread each: {vs_torch['encoder_cpu_one_thread']}")
                corpus_ids = {doc_id: i for i, doc_id in enumerate(Corpus.load(corpus).ids)}
                same = served_vs_torch(ports[0], {m: baselines[m] for m in names if m in baselines}, corpus_ids,
                                       recall_questions(n_questions))
                for method, figures in same.items():
                    vs_torch[method].update(figures)
                log(f"served default against torch: {same}")
            peaks.append(sum(served.peak_rss_mb() for served in served_all))
        for r in candidates.values():
            r.close()
        del candidates, bm25, baselines
    peak = round(max(peaks), 1)
    ratio = {m: round(service[m]["32"] / inprocess[m]["32"], 3) for m in service}
    log(f"ratio at batch 32: {ratio}, service peak RSS {peak} MB")

    if load > (os.cpu_count() or 1) * 0.5:
        notes.append(f"measured with the machine loaded (1-minute load {load:.1f} before the run, on "
                     f"{os.cpu_count()} CPUs): torch's "
                     "multi-threaded encode slows far more under load than ONNX Runtime's single-threaded sessions, "
                     "so the wall-clock ratios against torch overstate; rerun on a quiet machine "
                     "(vs_torch.encoder_cpu_one_thread is CPU time, which load barely moves)")
        log(notes[-1])
    result: dict[str, Any] = {"service_qps": service, "load_average_1m": round(load, 2), "inprocess_qps": inprocess, "ratio_b32": ratio,
                              "vs_torch": vs_torch, "recall_questions": n_questions,
                              "peak_rss_mb": peak, "status_429": dict(REFUSED), "replicas": args.replicas,
                              "workers": args.workers, "clients": CLIENTS, "k": K, "seconds_per_point": seconds,
                              "quick": args.quick, "notes": notes,
                              "dense_index_documents": sum(1 for _ in dense_corpus.open()) if wants_dense else None}
    if not args.skip_onnx:
        # --quick serves torch and onnx only (one service start less); int8 is measured in-process
        result["onnx"] = encoder_backends(dense_corpus, dense_index_dir, pool, seconds, n_questions,
                                          served=("torch", "onnx") if args.quick else BACKENDS)
    if not args.skip_ann:
        ann = ann_vs_exact(n_vectors, dims=dims)
        compressed = "sq8" if ann["sq8"]["recall_at_10"] >= ann["ivfpq"]["recall_at_10"] else "ivfpq"
        result["hnsw"] = ann["hnsw"]
        result["compressed"] = {"type": compressed, **ann[compressed]}
        result["ann"] = ann
        if n_vectors < 1_000_000:
            result["notes"].append(f"ANN figures on {n_vectors} vectors (--quick); the full run uses 1,000,000")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
