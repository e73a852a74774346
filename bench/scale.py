"""Scaling curves of the retriever backends: build time, memory, disk and served throughput against corpus size.

For each size (default 100k, 1M, 5M passages) and backend (bm25s, Lucene via pyserini, FAISS flat / HNSW /
SQ8, Milvus flat / HNSW on milvus-lite): `build_s` and `build_rss_mb` (wall seconds and peak RSS of the index
build in a child process; dense from ready embeddings), `rss_mb` (peak RSS of the served retriever, one
worker, after loading and answering: index and corpus text), `disk_mb` (the index on disk), `qps_b32` (`POST
/retrieve` at batch 32, k=10, 8 keep-alive clients, adaptive admission off: capacity is measured) and, dense
only, `recall_at_10` (the served top-10 against exact inner-product search over the same vectors; bm25: null).

Corpora are synthetic, from ../shared/data/corpus/combined.jsonl: real passage lengths, words drawn from its
unigram distribution, real titles (posting lists follow the real Zipf curve, co-occurrence does not: BM25 is a
little cheaper than on real text). Vectors: real MiniLM passage vectors plus gaussian noise (sigma 0.04),
normalised; queries are real questions. `--max` backend=size caps a backend's sizes (defaults: 1M for the text
backends, HNSW and Milvus, whose 5M builds take hours on 2 cores; 5M for FAISS flat and SQ8). Growth is fitted
(build_s, disk_mb: a*n^b; rss_mb: base + per-passage) and extrapolated to wiki-18's 21,015,324 passages.

    python bench/scale.py                       # ~1 h on 2 cores; corpora and vectors cached in var/scale
    python bench/scale.py --sizes 100000,1000000 --backends bm25s,faiss-flat
    python bench/scale.py --quick               # 2k and 10k passages, 1 s windows: checks the pipeline only
    python bench/scale.py --plot-only           # redraw docs/scale.png and reprint var/scale/result.json

Writes var/scale/result.json and docs/scale.png (with --plot). The last line printed is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, REPO, log  # noqa: E402
from bench.retriever_common import INDEX_DIR, ServedRetriever, peak_rss_mb  # noqa: E402
from bench.retriever_throughput import _service_rate, recall_questions  # noqa: E402

BACKENDS = ("bm25s", "pyserini", "faiss-flat", "faiss-hnsw", "faiss-sq8", "milvus-flat", "milvus-hnsw")
DEFAULT_MAX = {"bm25s": 1_000_000, "pyserini": 1_000_000, "faiss-flat": 5_000_000, "faiss-hnsw": 1_000_000,
               "faiss-sq8": 5_000_000, "milvus-flat": 1_000_000, "milvus-hnsw": 1_000_000}
WIKI18 = 21_015_324
DIMS = 384
NOISE = 0.04
K = 10
CHUNK = 50_000
WORK = REPO / "var" / "scale"
PLOT = REPO / "docs" / "scale.png"


def corpus_model(source: Path = CORPUS) -> tuple[list[str], np.ndarray, np.ndarray, list[str]]:
    """Vocabulary, its cumulative unigram probabilities, passage lengths (words) and titles of the real corpus."""
    counts: Counter[str] = Counter()
    lengths: list[int] = []
    titles: list[str] = []
    with source.open("rb") as fh:
        for line in fh:
            row = orjson.loads(line)
            words = row["text"].split()
            lengths.append(max(1, len(words)))
            titles.append(row.get("title") or "")
            counts.update(words)
    vocab = [w for w, _ in counts.most_common()]
    freq = np.array([counts[w] for w in vocab], dtype=np.float64)
    return vocab, np.cumsum(freq / freq.sum()), np.array(lengths, dtype=np.int64), titles


def write_corpus(n: int, out: Path, *, seed: int = 0) -> Path:
    """n synthetic passages (ids s0..s{n-1}) drawn from the real corpus's model; cached by size and seed."""
    meta = out.with_suffix(".json")
    want = {"n": n, "seed": seed, "source": CORPUS.name, "source_bytes": CORPUS.stat().st_size}
    if out.is_file() and meta.is_file() and json.loads(meta.read_text()) == want:
        return out
    vocab, cdf, lengths, titles = corpus_model()
    words = np.array(vocab, dtype=object)
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    t0 = time.perf_counter()
    with tmp.open("wb") as fh:
        for lo in range(0, n, CHUNK):
            m = min(CHUNK, n - lo)
            sizes = rng.choice(lengths, m)
            ids = np.minimum(np.searchsorted(cdf, rng.random(int(sizes.sum()))), len(vocab) - 1)
            picked = rng.integers(0, len(titles), m)
            ends = np.cumsum(sizes)
            lines = []
            for j in range(m):
                text = " ".join(words[ids[ends[j] - sizes[j]:ends[j]]])
                lines.append(orjson.dumps({"id": f"s{lo + j}", "title": titles[picked[j]], "text": text}))
            fh.write(b"\n".join(lines) + b"\n")
    os.replace(tmp, out)
    meta.write_text(json.dumps(want))
    log(f"corpus: {n} synthetic passages in {time.perf_counter() - t0:.0f} s -> {out}")
    return out


@functools.cache
def real_vectors() -> np.ndarray:
    """The real corpus's MiniLM passage vectors (the full-corpus embeddings when built, else encoded here)."""
    from services.retriever.dense import iter_chunks

    found = sorted(INDEX_DIR.glob("embeddings-*/manifest.json"))
    if found:
        return np.concatenate([np.asarray(c, dtype=np.float32) for c in iter_chunks(found[0].parent)])
    from services.retriever.corpus import Corpus
    from services.retriever.dense import Encoder
    from services.retriever.settings import EncoderSettings

    log("no full-corpus embeddings under var/indexes: encoding 1,000 real passages as centres")
    corpus = Corpus.load(CORPUS, limit=1_000)
    return Encoder(EncoderSettings()).encode_passages([corpus.passage(i) for i in range(len(corpus))])


def write_embeddings(corpus: Path, index_dir: Path, n: int, *, seed: int = 1) -> Path:
    """Synthetic vectors laid out as `embed_corpus` leaves them (chunks + manifest), for `corpus`'s checksum and
    the default encoder, so the index builders and the service take them as that corpus's embeddings."""
    from services.retriever.corpus import file_checksum
    from services.retriever.dense import embeddings_key, encoder_identity
    from services.retriever.manifest import Manifest
    from services.retriever.settings import EncoderSettings

    enc = EncoderSettings()
    checksum = file_checksum(corpus)
    done = index_dir / f"embeddings-{embeddings_key(checksum, enc)}"
    if (done / "manifest.json").is_file():
        return done
    centres = real_vectors()
    centres = centres / np.linalg.norm(centres, axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    work = done.with_name(done.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    for i, lo in enumerate(range(0, n, CHUNK)):
        m = min(CHUNK, n - lo)
        x = centres[rng.integers(0, len(centres), m)] + rng.standard_normal((m, DIMS), dtype=np.float32) * NOISE
        np.save(work / f"chunk-{i:06d}.npy", (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))
    Manifest(kind="embeddings", backend="synthetic", corpus_path=str(corpus), corpus_checksum=checksum,
             doc_count=n, encoder=enc.name, encoder_config=encoder_identity(enc), dims=DIMS,
             params={"chunk_size": CHUNK, "noise": NOISE, "centres": len(centres)}).write(work)
    os.replace(work, done)
    log(f"vectors: {n} synthetic in {time.perf_counter() - t0:.0f} s")
    return done


def exact_top10(embeddings: Path, queries: np.ndarray) -> np.ndarray:
    """Exact inner-product top-10 over every chunk (one chunk in memory at a time)."""
    import faiss

    from services.retriever.dense import iter_chunks
    from services.retriever.settings import FaissSettings

    faiss.cvar.distance_compute_blas_threshold = FaissSettings().blas_threshold  # as the service sets it
    best_s = np.full((len(queries), K), -np.inf, dtype=np.float32)
    best_i = np.full((len(queries), K), -1, dtype=np.int64)
    offset = 0
    for chunk in iter_chunks(embeddings):
        index = faiss.IndexFlatIP(DIMS)
        index.add(np.ascontiguousarray(chunk))
        s, i = index.search(queries, K)
        merged_s = np.concatenate([best_s, s], axis=1)
        merged_i = np.concatenate([best_i, i + offset], axis=1)
        order = np.argsort(-merged_s, axis=1, kind="stable")[:, :K]
        best_s = np.take_along_axis(merged_s, order, axis=1)
        best_i = np.take_along_axis(merged_i, order, axis=1)
        offset += len(chunk)
    return best_i


def backend_env(backend: str, size_dir: Path) -> dict[str, str]:
    """The retriever's environment serving `backend` (one method, one worker)."""
    if backend in ("bm25s", "pyserini"):
        return {"RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "false", "RETRIEVER_BM25_BACKEND": backend,
                "RETRIEVER_DEFAULT_METHOD": "bm25"}
    env = {"RETRIEVER_BM25": "false", "RETRIEVER_DENSE": "true", "RETRIEVER_DEFAULT_METHOD": "dense"}
    family, kind = backend.split("-")
    if family == "faiss":
        return {**env, "RETRIEVER_FAISS__INDEX_TYPE": kind}
    return {**env, "RETRIEVER_DENSE_BACKEND": "milvus", "RETRIEVER_MILVUS__INDEX_TYPE": kind,
            "RETRIEVER_MILVUS__URI": str(size_dir / f"milvus-{kind}.db"),
            "RETRIEVER_MILVUS__COLLECTION": f"scale_{kind}"}


def index_paths(backend: str, size_dir: Path) -> list[Path]:
    """What the backend keeps on disk (the disk_mb figure)."""
    index_dir = size_dir / "index"
    if backend in ("bm25s", "pyserini"):
        return [index_dir / backend]
    family, kind = backend.split("-")
    if family == "faiss":
        return [index_dir / f"dense-{kind}"]
    return [size_dir / f"milvus-{kind}.db", index_dir / f"milvus-scale_{kind}"]


def build_child(backend: str, size_dir: Path) -> None:
    """Runs in the child: build `backend`'s index for the corpus in size_dir (embeddings already there)."""
    from services.retriever.settings import RetrieverSettings

    for key, value in backend_env(backend, size_dir).items():
        os.environ[key] = value
    settings = RetrieverSettings(corpus=size_dir / "corpus.jsonl", index_dir=size_dir / "index")
    t0 = time.perf_counter()
    if backend in ("bm25s", "pyserini"):
        from services.retriever.cli import build

        build(settings, bm25=[backend], dense=False, force=True, show_progress=False)
    else:
        from services.retriever.dense import build_faiss, dense_folder

        embeddings = next(p.parent for p in settings.index_dir.glob("embeddings-*/manifest.json")
                          if not p.parent.name.endswith(".partial"))
        if backend.startswith("faiss"):
            build_faiss(embeddings, dense_folder(settings.index_dir, settings.faiss.index_type), settings.faiss,
                        show_progress=False)
        else:
            from services.retriever.milvus import build_milvus

            build_milvus(embeddings, settings.index_dir, settings.milvus, force=True, show_progress=False)
    build_s = round(time.perf_counter() - t0, 2)
    # this process's peak since exec (wait4's ru_maxrss would count the parent's), or a helper process it ran
    # and waited for (Lucene's indexer JVM) if that one's was larger
    peak = max(peak_rss_mb(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    print(json.dumps({"build_s": build_s, "build_rss_mb": round(peak, 1)}))


def run_build(backend: str, size_dir: Path) -> dict[str, float]:
    for path in index_paths(backend, size_dir):
        shutil.rmtree(path, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, __file__, "--build-child", backend, str(size_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = (b.decode(errors="replace") for b in proc.communicate())
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} build failed ({proc.returncode}): {err[-2000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def disk_mb(paths: list[Path]) -> float:
    files = [p for root in paths for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()]
    return round(sum(p.stat().st_size for p in files) / 2**20, 1)


def served_ids(port: int, questions: list[str], method: str) -> list[list[str]]:
    import httpx

    out: list[list[str]] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        for i in range(0, len(questions), 32):
            r = client.post("/retrieve", json={"queries": questions[i:i + 32], "k": K, "method": method})
            r.raise_for_status()
            out += [[hit["id"] for hit in hits] for hits in r.json()["results"]]
    return out


def measure(backend: str, size_dir: Path, pool: list[str], seconds: float, truth: np.ndarray | None,
            recall_qs: list[str]) -> dict[str, Any]:
    built = run_build(backend, size_dir)
    log(f"  {backend}: built in {built['build_s']} s (child peak RSS {built['build_rss_mb']} MB)")
    point: dict[str, Any] = {**built, "disk_mb": disk_mb(index_paths(backend, size_dir))}
    method = "bm25" if backend in ("bm25s", "pyserini") else "dense"
    # capacity, not admission: the adaptive limit would shed some of the 8 closed-loop clients (they would
    # back off for Retry-After) once merged batches make latency grow; the ceiling stays. Nor the request
    # deadline: SQ8 at 5M answers ~1 query/s, so 8 queued batches of 32 wait past the default 120 s
    env = {**backend_env(backend, size_dir), "RETRIEVER_WORKERS": "1", "RETRIEVER_ADAPTIVE_CONCURRENCY": "false",
           "RETRIEVER_REQUEST_TIMEOUT_S": "3600"}
    t0 = time.perf_counter()
    with ServedRetriever(env, timeout=3600, corpus=size_dir / "corpus.jsonl", index_dir=size_dir / "index") as srv:
        point["load_s"] = round(time.perf_counter() - t0, 1)
        point["qps_b32"] = round(asyncio.run(_service_rate([srv.port], method, 32, pool, seconds)), 1)
        point["recall_at_10"] = None
        if truth is not None:
            got = served_ids(srv.port, recall_qs, method)
            want = [{f"s{i}" for i in row} for row in truth]
            point["recall_at_10"] = round(float(np.mean([len(set(g) & w) / K for g, w in zip(got, want, strict=True)])), 4)
        point["rss_mb"] = round(srv.peak_rss_mb(), 1)
    return point


def fit(sizes: list[int], values: list[float], kind: str) -> dict[str, float] | None:
    """power: value = a * n^b (least squares in log-log); linear: value = base + per_item * n."""
    pts = [(n, v) for n, v in zip(sizes, values, strict=True) if v is not None and v > 0]
    if len(pts) < 2:
        return None
    x = np.array([p[0] for p in pts], dtype=np.float64)
    y = np.array([p[1] for p in pts], dtype=np.float64)
    if kind == "power":
        b, log_a = np.polyfit(np.log(x), np.log(y), 1)
        return {"a": float(np.exp(log_a)), "b": float(b)}
    per_item, base = np.polyfit(x, y, 1)
    return {"base": float(base), "per_item": float(per_item)}


def predict(model: dict[str, float], n: float) -> float:
    if "b" in model:
        return model["a"] * n ** model["b"]
    return model["base"] + model["per_item"] * n


def extrapolate(backends: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, points in backends.items():
        sizes = sorted(int(s) for s in points)
        row: dict[str, Any] = {}
        for metric, kind in (("build_s", "power"), ("rss_mb", "linear"), ("disk_mb", "power")):
            model = fit(sizes, [points[str(s)].get(metric) for s in sizes], kind)
            if model is not None:
                row[metric] = round(predict(model, WIKI18), 1)
                row[f"{metric}_fit"] = {k: round(v, 8) for k, v in model.items()}
        if row:
            row["from_sizes"] = sizes
            out[name] = row
    return out


def plot(result: dict[str, Any], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("build_s", "build (s)"), ("rss_mb", "served peak RSS (MB)"), ("disk_mb", "index on disk (MB)"),
               ("qps_b32", "served queries/s, batch 32"))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    grid = np.logspace(np.log10(min(result["sizes"])), np.log10(WIKI18), 50)
    for ax, (metric, label) in zip(axes.flat, metrics, strict=True):
        for i, (name, points) in enumerate(result["backends"].items()):
            sizes = sorted(int(s) for s in points)
            values = [points[str(s)].get(metric) for s in sizes]
            colour = f"C{i}"
            ax.plot(sizes, values, "o-", color=colour, label=name)
            model = fit(sizes, values, "linear" if metric == "rss_mb" else "power")
            if model is not None and metric != "qps_b32":
                ax.plot(grid, [predict(model, n) for n in grid], "--", color=colour, alpha=0.5)
        ax.axvline(WIKI18, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("passages (grey line: wiki-18, 21M; dashed: fitted growth)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Retriever backends against corpus size (2 CPU cores; synthetic corpora from the real vocabulary)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def parse_max(values: list[str]) -> dict[str, int]:
    out = dict(DEFAULT_MAX)
    for item in values:
        name, _, size = item.partition("=")
        if name not in BACKENDS or not size.isdigit():
            raise SystemExit(f"--max wants BACKEND=SIZE with BACKEND in {', '.join(BACKENDS)}, got {item!r}")
        out[name] = int(size)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--build-child":
        build_child(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="comma-separated passage counts (default 100000,1000000,"
                        "5000000; --quick 2000,10000)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--max", action="append", default=[], metavar="BACKEND=SIZE",
                        help="largest size a backend runs at (repeatable); defaults: "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_MAX.items()))
    parser.add_argument("--seconds", type=float, default=None, help="measured window per point (default 10)")
    parser.add_argument("--recall-questions", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and windows: checks the pipeline only")
    parser.add_argument("--work", type=Path, default=WORK, help="where corpora, vectors and indexes go")
    parser.add_argument("--plot", action="store_true", help=f"draw {PLOT.relative_to(REPO)} from the result")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from <work>/result.json and print it "
                        "(with the extrapolation) as the final line")
    parser.add_argument("--update", action="store_true", help="merge these points into <work>/result.json "
                        "(re-measure some backends or sizes without repeating the others)")
    args = parser.parse_args()
    result_path = args.work / "result.json"
    if args.plot_only:  # e.g. after a run stopped part-way: its points are in result.json after each one
        saved = json.loads(result_path.read_text())
        saved["extrapolated_21m"] = extrapolate(saved["backends"])
        result_path.write_text(json.dumps(saved, indent=1))
        plot(saved)
        print(json.dumps(saved))
        return
    sizes = [int(s) for s in (args.sizes or ("2000,10000" if args.quick else "100000,1000000,5000000")).split(",")]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    largest = parse_max(args.max)
    seconds = args.seconds or (1.0 if args.quick else 10.0)

    from services.retriever.dense import Encoder
    from services.retriever.settings import EncoderSettings

    pool = recall_questions(4000)
    recall_qs = recall_questions(args.recall_questions)
    query_vectors = Encoder(EncoderSettings()).encode_queries(recall_qs)
    results: dict[str, dict[str, dict[str, Any]]] = {b: {} for b in backends}
    skipped: list[dict[str, Any]] = []
    run_sizes = sizes
    if args.update and result_path.is_file():
        previous = json.loads(result_path.read_text())
        for name, points in previous["backends"].items():
            results.setdefault(name, {}).update(points)
        skipped = [row for row in previous.get("skipped", [])
                   if not (row["backend"] in backends and row["size"] in sizes)]
        sizes = sorted(set(sizes) | set(previous["sizes"]))
    t_all = time.perf_counter()
    for n in run_sizes:
        todo = [b for b in backends if n <= largest[b]]
        skipped += [{"backend": b, "size": n, "why": f"above its --max ({largest[b]}): its build at this size takes "
                     "too long on 2 cores; see the extrapolation"} for b in backends if b not in todo]
        if not todo:
            continue
        size_dir = args.work / f"n{n}"
        corpus = write_corpus(n, size_dir / "corpus.jsonl")
        truth = None
        if any(b not in ("bm25s", "pyserini") for b in todo):
            embeddings = write_embeddings(corpus, size_dir / "index", n)
            truth = exact_top10(embeddings, query_vectors)
        for backend in todo:
            log(f"size {n}: {backend}")
            try:
                point = measure(backend, size_dir, pool, seconds, truth if backend not in ("bm25s", "pyserini")
                                else None, recall_qs)
            except (RuntimeError, OSError, MemoryError) as exc:
                log(f"  {backend} at {n} failed: {exc}")
                skipped.append({"backend": backend, "size": n, "why": f"failed: {str(exc)[-300:]}"})
            else:
                results[backend][str(n)] = point
                log(f"  {backend} at {n}: {point}")
            # after every point, failed ones too: a run stopped part-way keeps what it found (--plot-only)
            partial = {"sizes": sizes, "backends": results, "skipped": skipped}
            args.work.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(partial, indent=1))
        for backend in todo:  # free the disk before the next size (corpora and vectors stay cached)
            for path in index_paths(backend, size_dir):
                shutil.rmtree(path, ignore_errors=True)
    result: dict[str, Any] = {
        "sizes": sizes, "backends": {b: v for b, v in results.items() if v},
        "extrapolated_21m": extrapolate({b: v for b, v in results.items() if v}),
        "skipped": skipped, "seconds_per_point": seconds, "quick": args.quick, "cpu_cores": os.cpu_count(),
        "corpus": "synthetic: real lengths, unigram words and titles of ../shared/data/corpus/combined.jsonl",
        "vectors": f"real MiniLM passage vectors + N(0, {NOISE}^2) noise, normalised, {DIMS}-d",
        "wall_s": round(time.perf_counter() - t_all, 1)}
    result_path.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
