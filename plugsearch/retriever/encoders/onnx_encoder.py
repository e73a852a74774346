"""The dense encoder on ONNX Runtime: what `RETRIEVER_ENCODER__BACKEND=auto` (the default) serves on CPUs,
and what `onnx` / `onnx-int8` ask for explicitly.

The model's transformer is exported to ONNX once per model and variant into `RETRIEVER_ENCODER__ONNX_DIR` (a
folder named after the model and a digest of its config and weights, reused by every later start and
worker; the image ships the default model's export), then run by onnxruntime on the CPU:
- fp32 (`auto`, `onnx`): the graph after onnxruntime's BERT fusions (one Attention kernel per layer, embeddings
  + layer norm, residual + layer norm, bias + GELU: 46 operators for MiniLM instead of ~300), checked once
  against the torch model on sample texts before it is ever served (a graph that differs is refused, and
  `auto` serves torch);
- `onnx-int8`: that export with its weights dynamically quantized to int8 (faster, slightly different vectors).
Tokenization (the model's fast tokenizer), pooling and normalisation follow sentence-transformers: fp32
vectors equal the torch backend's up to float error (same top-k, tested).

A batch is tokenized once, sorted by length and cut into chunks that each pad to their own longest text,
where the cut points minimise padded tokens plus a per-call cost (`plan_chunks`); the chunks run on
`threads` single-threaded sessions side by side (cheaper on a few cores than one call whose every operator
is split across threads).

Why not sentence-transformers' `backend="onnx"`: it goes through optimum-onnx, whose only release pins
transformers<4.58 while sentence-transformers 6 needs transformers>=5. The export uses torch.onnx
(TorchScript exporter with eager attention, whose graph onnxruntime's fusions recognise; the torch.export
exporter, which needs `onnx` and `onnxscript`, when that fails). Serving an export needs only onnxruntime.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from plugsearch.common.files import atomic_path, atomic_write_json
from plugsearch.retriever.settings import EncoderSettings

logger = logging.getLogger(__name__)

EXPORT_FORMAT = 2  # bump when the export itself changes (opset, inputs, exporter), so old files are not reused
OPSET = 17
FP32 = "model.onnx"
FUSED = "model-fused.onnx"
"""the fp32 graph after onnxruntime's transformer fusions: what `auto` and `onnx` serve"""
INT8 = "model-int8.onnx"
RECORD = "export.json"
"""what was exported and how (exporter, check against torch, sha256 of every file served)"""
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SUPPORTED_MODULES = {"Transformer", "Pooling", "Normalize"}
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}
CALL_COST_TOKENS = 24
"""the fixed cost of one session call, in padded tokens' worth of work (MiniLM on 2 cores: a call of one
8-token text costs about what 24 more tokens in a bigger call cost); `plan_chunks` trades it against padding"""
MAX_CHUNK_TOKENS = 4096
"""padded tokens per call at most (bounds the activations of long passages)"""
CHECK_TOLERANCE = 1e-4
"""largest difference allowed between the ONNX graph's and torch's hidden states (relative to their largest
magnitude) before the export is refused; MiniLM differs by ~1e-6"""
CHECK_TEXTS = (
    "who wrote the declaration of independence",
    "a",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",
    "what is the capital city of australia and when was it founded?",
    "Ünïcödé, numbers 1,234.5 and punctuation!?",
    "when did the first man land on the moon " * 40,  # longer than most max_seq_length: truncation
)


class OnnxUnavailable(RuntimeError):
    """The onnx backend cannot serve this model (missing package, unsupported model layout, unwritable cache,
    an export that fails or differs from torch)."""


def model_digest(path: Path) -> str:
    """What the exported graph depends on: the model's config and weights (content, not dates)."""
    h = hashlib.sha256(f"format={EXPORT_FORMAT};opset={OPSET}".encode())
    files = [path / "config.json", *[path / n for n in WEIGHT_FILES if (path / n).is_file()]]
    if not (path / "config.json").is_file() or len(files) < 2:
        raise OnnxUnavailable(f"the onnx backend needs a local transformers model folder (config.json and "
                              f"{' or '.join(WEIGHT_FILES)}); {path} has none")
    for file in files:
        h.update(file.name.encode())
        h.update(_file_sha256(file).encode())
    return h.hexdigest()[:16]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export_folder(onnx_dir: Path, model_path: Path) -> Path:
    return onnx_dir / f"{model_path.name}-{model_digest(model_path)}"


@contextlib.contextmanager
def _export_lock(folder: Path) -> Iterator[None]:
    """One exporter at a time per folder (several workers start together); the others wait, then reuse."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fh = (folder / ".lock").open("a")
    except OSError as exc:
        raise OnnxUnavailable(f"cannot write the ONNX export to {folder} ({exc}): point "
                              "RETRIEVER_ENCODER__ONNX_DIR at a writable folder") from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Converters print progress, warn about their own internals and log every tensor they skip through the
    root logger: one-off noise, kept out of the log."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


@contextlib.contextmanager
def _written(out: Path) -> Iterator[Path]:
    """A temporary path, renamed onto `out` once written (quietly)."""
    with atomic_path(out) as tmp, _quiet():
        yield tmp


def _input_names(tokenizer: Any) -> list[str]:
    return [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tokenizer.model_input_names]


def export_fp32(model_path: Path, out: Path) -> str:
    """torch model -> ONNX graph (input ids etc. -> last hidden state), batch and sequence dynamic.
    Returns the exporter used."""
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        raise OnnxUnavailable(f"exporting the encoder to ONNX needs torch and transformers: {exc}") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    names = _input_names(tokenizer)

    class LastHidden(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            return self.inner(**dict(zip(names, args, strict=True))).last_hidden_state

    # two texts of different lengths: the traced graph takes the padded (masked) path
    sample = tokenizer(["an export sample, longer than the other one", "short"], padding=True,
                       return_tensors="pt")
    args = tuple(sample[n] for n in names)
    try:
        # TorchScript exporter, eager attention: the plain MatMul/Softmax pattern that onnxruntime fuses into
        # its Attention kernel (a few seconds)
        model = AutoModel.from_pretrained(str(model_path), attn_implementation="eager").eval()
        axes = {n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]}
        with _written(out) as tmp, torch.no_grad():
            torch.onnx.export(LastHidden(model), args, str(tmp), input_names=names,
                              output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=OPSET,
                              dynamo=False)
        return "torchscript"
    except Exception as exc:  # noqa: BLE001 - any exporter failure: try the other exporter
        logger.info("onnx encoder: the TorchScript exporter failed on %s (%s: %s); trying torch.export",
                    model_path, type(exc).__name__, exc)
    try:
        import onnx  # noqa: F401 - the torch.export exporter needs both
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise OnnxUnavailable(f"exporting {model_path} needs onnx and onnxscript (pip install "
                              f"'plugsearch[onnx]'): {exc}") from exc
    model = AutoModel.from_pretrained(str(model_path)).eval()
    dynamic = tuple({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC} for _ in names)
    with _written(out) as tmp, torch.no_grad():
        torch.onnx.export(LastHidden(model), args, str(tmp), input_names=names,
                          output_names=["last_hidden_state"], dynamic_shapes={"args": dynamic},
                          opset_version=18, dynamo=True, external_data=False)
    return "torch.export"


def quantize_int8(source: Path, out: Path) -> None:
    """Dynamic int8 quantization of the weights (activations quantized at run time; no calibration data)."""
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as exc:
        raise OnnxUnavailable(f"int8 quantization needs onnxruntime's quantizer and onnx: {exc}") from exc
    with _written(out) as tmp:
        # MatMul weights only, one scale per output channel: mean cosine to the fp32 vectors 0.993 on 300
        # NQ/HotpotQA questions (MiniLM), against 0.965 with onnxruntime's defaults (per tensor, all ops)
        quantize_dynamic(str(source), str(tmp), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                         per_channel=True)


def fuse(source: Path, out: Path, model_path: Path) -> dict[str, int]:
    """onnxruntime's BERT graph fusions (attention, embeddings + layer norm, residual + layer norm, bias +
    GELU) into fused kernels: the same vectors, fewer and faster operators. Operators they do not match stay
    as they are. Returns the fused operators' counts."""
    from onnxruntime.transformers.optimizer import optimize_model

    config = json.loads((model_path / "config.json").read_text())
    heads, hidden = int(config.get("num_attention_heads", 0)), int(config.get("hidden_size", 0))
    with _written(out) as tmp:
        model = optimize_model(str(source), model_type="bert", num_heads=heads, hidden_size=hidden)
        model.save_model_to_file(str(tmp))
        stats = model.get_fused_operator_statistics()
    return {name: int(n) for name, n in stats.items() if n}


def check_against_torch(model_path: Path, graph: Path) -> float:
    """The graph's hidden states against the torch model's on CHECK_TEXTS (one padded batch, then each text
    alone), at the positions that count (not padding): the largest difference relative to the largest
    magnitude. Raises OnnxUnavailable above CHECK_TOLERANCE."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModel.from_pretrained(str(model_path)).eval()
    sess = session(graph, 1)
    inputs = {i.name for i in sess.get_inputs()}
    worst, scale = 0.0, 1.0
    for texts in [list(CHECK_TEXTS), *[[t] for t in CHECK_TEXTS]]:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="np")
        with torch.no_grad():
            expected = model(**{k: torch.from_numpy(v) for k, v in enc.items()}).last_hidden_state.numpy()
        got = sess.run(None, {k: np.asarray(v, dtype=np.int64) for k, v in enc.items() if k in inputs})[0]
        valid = enc["attention_mask"].astype(bool)
        scale = max(scale, float(np.abs(expected[valid]).max()))
        worst = max(worst, float(np.abs(got[valid] - expected[valid]).max()))
    relative = worst / scale
    if not relative <= CHECK_TOLERANCE:  # also refuses NaN
        raise OnnxUnavailable(f"the ONNX export of {model_path} differs from the torch model by {relative:.2g} "
                              f"(relative; more than {CHECK_TOLERANCE:g} allowed): not served")
    return relative


def _read_record(folder: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((folder / RECORD).read_text()))
    except (OSError, ValueError):
        return {}


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    atomic_write_json(folder / RECORD, record, indent=2)


def _reusable(folder: Path, name: str, record: dict[str, Any]) -> bool:
    """The file exists and is the one recorded (sha256): not truncated, not replaced behind our back."""
    file = folder / name
    return file.is_file() and record.get("files", {}).get(name) == _file_sha256(file)


def ensure_export(model_path: Path, onnx_dir: Path, *, int8: bool) -> Path:
    """The ONNX file for this model and variant: exported (once, logged, checked against torch) when missing,
    else reused after its sha256 is checked against the record. Raises OnnxUnavailable when the model cannot
    be exported or was found to differ from torch (both recorded, so later starts do not try again), or when
    something it needs is missing (a package, a writable folder, disk space: not recorded)."""
    folder = export_folder(onnx_dir, model_path)
    name = INT8 if int8 else FUSED
    record = _read_record(folder)
    if _reusable(folder, name, record):
        logger.info("onnx encoder: reusing %s (sha256 checked)", folder / name)
        return folder / name
    if record.get("refused") and not int8:
        raise OnnxUnavailable(_refused(record, folder))
    with _export_lock(folder):
        record = _read_record(folder)  # another worker may have exported it while this one waited
        if _reusable(folder, name, record):
            logger.info("onnx encoder: reusing %s (sha256 checked)", folder / name)
            return folder / name
        if record.get("refused") and not int8:
            raise OnnxUnavailable(_refused(record, folder))
        try:
            record = _export(model_path, folder, name, record)
        except OnnxUnavailable:  # a missing package...: not the model's fault, not recorded
            raise
        except OSError as exc:  # a full disk, a permission...: not the model's fault either
            raise OnnxUnavailable(f"exporting {model_path} to ONNX in {folder} failed: {exc}") from exc
        except Exception as exc:  # the exporter or a converter cannot handle this model: recorded
            failure = f"exporting {model_path} to ONNX failed: {type(exc).__name__}: {exc}"
            if int8:
                raise OnnxUnavailable(failure) from exc
            record["refused"] = failure
        finally:
            for stale in folder.glob(".*.tmp"):
                stale.unlink(missing_ok=True)
        _write_record(folder, record)
        if record.get("refused") and not int8:
            raise OnnxUnavailable(_refused(record, folder))
    return folder / name


def _refused(record: dict[str, Any], folder: Path) -> str:
    return f"{record['refused']} (recorded in {folder / RECORD}; remove that folder to try again)"


def _export(model_path: Path, folder: Path, name: str, record: dict[str, Any]) -> dict[str, Any]:
    record = {"model": str(model_path), "format": EXPORT_FORMAT, "opset": OPSET, "files": {},
              **{k: v for k, v in record.items() if k in ("exporter", "fused", "check", "refused", "files")}}
    fp32 = folder / FP32
    if not _reusable(folder, FP32, record):
        logger.info("onnx encoder: exporting %s to ONNX once (reused by later starts): %s", model_path, fp32)
        t0 = time.perf_counter()
        record["exporter"] = export_fp32(model_path, fp32)
        record["files"][FP32] = _file_sha256(fp32)  # a fused or int8 file made before stays valid: same model
        logger.info("onnx encoder: exported %s in %.1f s (%s exporter)", fp32, time.perf_counter() - t0,
                    record["exporter"])
    t0 = time.perf_counter()
    if name == INT8:
        logger.info("onnx encoder: quantizing to int8 once: %s", folder / name)
        quantize_int8(fp32, folder / name)
    else:
        logger.info("onnx encoder: fusing the graph's transformer operators once: %s", folder / name)
        record["fused"] = fuse(fp32, folder / name, model_path)
        try:
            record["check"] = {"max_relative_difference": check_against_torch(model_path, folder / name),
                               "texts": len(CHECK_TEXTS)}
        except OnnxUnavailable as exc:
            record["refused"] = str(exc)
            (folder / name).unlink(missing_ok=True)
            return record
        logger.info("onnx encoder: %s checked against torch (hidden states within %.1g, relative) in %.1f s; "
                    "fused %s", folder / name, record["check"]["max_relative_difference"],
                    time.perf_counter() - t0, record["fused"])
    record["files"][name] = _file_sha256(folder / name)
    return record


def sentence_transformers_layout(model_path: Path, pooling: str) -> tuple[str, bool, bool]:
    """(pooling mode, model normalises, lower-case inputs) as sentence-transformers would load the model."""
    bert_config = model_path / "sentence_bert_config.json"
    lower = bert_config.is_file() and bool(json.loads(bert_config.read_text()).get("do_lower_case", False))
    if pooling != "model":
        return pooling, False, lower
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return "mean", False, lower  # sentence-transformers' default for a plain transformers model
    modules = json.loads(modules_file.read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    unsupported = [k for k in kinds if k not in SUPPORTED_MODULES]
    if unsupported:
        raise OnnxUnavailable(f"the onnx backend runs Transformer + Pooling (+ Normalize) models; {model_path} "
                              f"also has {', '.join(unsupported)}: use RETRIEVER_ENCODER__BACKEND=torch")
    mode = "mean"
    for module in modules:
        if module["type"].endswith("Pooling"):
            config = json.loads((model_path / module["path"] / "config.json").read_text())
            on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
            if len(on) != 1 or on[0] not in POOLING_MODES:
                raise OnnxUnavailable(f"the onnx backend pools by one of mean, cls or max; {model_path} asks for "
                                      f"{config}: use RETRIEVER_ENCODER__BACKEND=torch")
            mode = POOLING_MODES[on[0]]
    return mode, "Normalize" in kinds, lower


def _cuda_torch() -> bool:
    """A CUDA build of torch that sees a GPU (a CPU build is recognised without importing torch)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    if "+cpu" in version:
        return False
    import torch

    return bool(torch.cuda.is_available())


def auto_blocker(settings: EncoderSettings) -> tuple[str, bool] | None:
    """Why `auto` serves torch without trying ONNX Runtime, and whether that is by design (a GPU: torch is the
    right choice there) rather than something missing; None when it should try."""
    if settings.device not in (None, "cpu"):
        return (f"RETRIEVER_ENCODER__DEVICE={settings.device}: torch serves GPUs (onnxruntime runs on the CPU "
                "here)", True)
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed (pip install 'plugsearch[onnx]')", False
    if settings.device is None and _cuda_torch():
        return "torch sees a GPU (set RETRIEVER_ENCODER__DEVICE=cpu for ONNX Runtime on the CPU)", True
    return None


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota (a container's CPU limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = max(1, threads)
    # idle pool threads sleep instead of spinning: the service's event loop shares the cores with them
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def plan_chunks(lengths: npt.NDArray[np.int64], *, call_cost: int = CALL_COST_TOKENS,
                max_tokens: int = MAX_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """Cut lengths sorted longest first into runs [start, stop), each padded to its first (longest) length,
    minimising padded tokens + call_cost per run, with at most max_tokens padded tokens per run (a single
    text may exceed it). Exact (dynamic programming over every cut point)."""
    n = len(lengths)
    if n == 0:
        return []
    width = lengths.astype(np.float64)
    best = np.zeros(n + 1)
    back = np.zeros(n + 1, dtype=np.int64)
    for stop in range(1, n + 1):
        # a run [start, stop) costs call_cost + (stop - start) * width[start]; runs over the cap are out
        # (their start lies before `low`: width[start] >= width[stop-1], so the first fitting start bounds it)
        low = max(0, stop - max(1, max_tokens // max(1, int(width[stop - 1]))))
        starts = np.arange(low, stop)
        costs = best[low:stop] + call_cost + (stop - starts) * width[low:stop]
        costs[(stop - starts) * width[low:stop] > max_tokens] = np.inf
        costs[-1] = best[stop - 1] + call_cost + width[stop - 1]  # one text alone always fits
        pick = int(np.argmin(costs))
        back[stop] = low + pick
        best[stop] = costs[pick]
    runs = []
    stop = n
    while stop > 0:
        runs.append((int(back[stop]), stop))
        stop = int(back[stop])
    return runs[::-1]


class OnnxModel:
    """Tokenizer + ONNX Runtime sessions + numpy pooling: texts -> float32 vectors."""

    def __init__(self, model_path: str | Path, settings: EncoderSettings) -> None:
        self.path = Path(model_path)
        if not self.path.is_dir():
            raise OnnxUnavailable(f"the onnx backend loads local models only; {model_path} is not a folder "
                                  "(nothing is downloaded)")
        self.settings = settings
        self.pooling, self.model_normalizes, self.lower = sentence_transformers_layout(self.path, settings.pooling)
        self.file = ensure_export(self.path, settings.onnx_dir, int8=settings.backend == "onnx-int8")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.threads = settings.threads or available_cpus()
        try:
            self.session = session(self.file, 1)
            self.inputs = [i.name for i in self.session.get_inputs()]
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="onnx") if self.threads > 1 else None
            self.dims = int(self.encode(["dimension probe"], 1, normalize=False).shape[1])
        except Exception as exc:  # an operator onnxruntime lacks, an input it does not expect...
            raise OnnxUnavailable(f"onnxruntime cannot run {self.file}: {type(exc).__name__}: {exc}") from exc

    def _tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if self.lower:
            texts = [t.lower() for t in texts]
        enc = self.tokenizer(list(texts), padding=False, truncation="longest_first",
                             max_length=self.settings.max_seq_length, return_attention_mask=False,
                             return_token_type_ids=False)
        return list(enc["input_ids"])

    def _forward(self, ids: list[list[int]]) -> npt.NDArray[np.float32]:
        """Pooled vectors of texts (token ids, longest first), padded to the first."""
        width = len(ids[0])
        input_ids = np.full((len(ids), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for row, tokens in enumerate(ids):
            input_ids[row, :len(tokens)] = tokens
            mask[row, :len(tokens)] = 1
        feed = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(mask)}
        hidden = self.session.run(None, {name: feed[name] for name in self.inputs})[0]
        if self.pooling == "cls":
            return np.asarray(hidden[:, 0], dtype=np.float32)
        weights = mask[:, :, None].astype(np.float32)
        if self.pooling == "max":
            return np.asarray(np.where(weights > 0, hidden, -1e9).max(axis=1), dtype=np.float32)
        summed = (hidden * weights).sum(axis=1)
        return np.asarray(summed / np.clip(weights.sum(axis=1), 1e-9, None), dtype=np.float32)

    def encode(self, texts: Sequence[str], batch_size: int, *, normalize: bool) -> npt.NDArray[np.float32]:
        """Vectors in input order. `batch_size` is not used: the chunks follow the texts' lengths."""
        if not texts:
            return np.zeros((0, getattr(self, "dims", 0)), dtype=np.float32)
        ids = self._tokenize(texts)
        lengths = np.fromiter((len(t) for t in ids), dtype=np.int64, count=len(ids))
        order = np.argsort(-lengths, kind="stable")
        # chunks small enough to keep every thread busy (1.5 per thread: the least makespan in a simulation over
        # the question sets' lengths, 2 threads, batches of 4 to 512)
        share = math.ceil(int(lengths.sum()) / (1.5 * self.threads)) if self.threads > 1 else MAX_CHUNK_TOKENS
        runs = plan_chunks(lengths[order], max_tokens=min(MAX_CHUNK_TOKENS, max(share, int(lengths.max()))))
        parts = [[ids[i] for i in order[lo:hi]] for lo, hi in runs]
        if self._pool is None or len(parts) == 1:
            pooled = [self._forward(p) for p in parts]
        else:  # biggest first, so that the last chunks to start are small ones
            by_cost = sorted(range(len(parts)), key=lambda c: -len(parts[c]) * len(parts[c][0]))
            futures = {c: self._pool.submit(self._forward, parts[c]) for c in by_cost}
            pooled = [futures[c].result() for c in range(len(parts))]
        vectors = np.empty((len(texts), pooled[0].shape[1]), dtype=np.float32)
        vectors[order] = np.concatenate(pooled)
        if normalize or self.model_normalizes:
            vectors /= np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)
        return np.ascontiguousarray(vectors)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
