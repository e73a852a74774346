"""The dense encoder on ONNX Runtime (`RETRIEVER_ENCODER__BACKEND=onnx` or `onnx-int8`).

The model's transformer is exported to ONNX once per model and variant into `RETRIEVER_ENCODER__ONNX_DIR` (a
folder named after the model and a digest of its config and weights, reused by every later start and
worker), then run by onnxruntime on the CPU: `onnx` after onnxruntime's transformer fusions (same vectors,
fewer operators), `onnx-int8` with the weights dynamically quantized to int8. Tokenization (the model's fast
tokenizer), pooling and normalisation follow sentence-transformers: fp32 vectors equal the torch backend's
up to float error.

Why not sentence-transformers' `backend="onnx"`: it goes through optimum-onnx, whose only release pins
transformers<4.58 while sentence-transformers 6 needs transformers>=5. The export here uses torch.onnx's
torch.export-based exporter (needs `onnx` and `onnxscript`; serving an export needs only onnxruntime).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from services.retriever.manifest import atomic_file
from services.retriever.settings import EncoderSettings

logger = logging.getLogger(__name__)

EXPORT_FORMAT = 1  # bump when the export itself changes (opset, inputs, exporter), so old files are not reused
OPSET = 18
FP32 = "model.onnx"
FUSED = "model-fused.onnx"
"""the fp32 graph with onnxruntime's transformer fusions (SkipLayerNormalization, BiasGelu): what `onnx` serves"""
INT8 = "model-int8.onnx"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SUPPORTED_MODULES = {"Transformer", "Pooling", "Normalize"}
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}
# texts per onnxruntime call, after sorting by length: a merged batch of 256 questions ran 2-3x faster in
# chunks of 32 than in one call padded to its longest question (MiniLM, 2 cores)
MAX_CHUNK = 32


class OnnxUnavailable(RuntimeError):
    """The onnx backend cannot serve this model (missing package, unsupported model layout, unwritable cache)."""


def model_digest(path: Path) -> str:
    """What the exported graph depends on: the model's config and weights (content, not dates)."""
    h = hashlib.sha256(f"format={EXPORT_FORMAT};opset={OPSET}".encode())
    files = [path / "config.json", *[path / n for n in WEIGHT_FILES if (path / n).is_file()]]
    if not (path / "config.json").is_file() or len(files) < 2:
        raise OnnxUnavailable(f"the onnx backend needs a local transformers model folder (config.json and "
                              f"{' or '.join(WEIGHT_FILES)}); {path} has none")
    for file in files:
        h.update(file.name.encode())
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


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
def _written(out: Path) -> Iterator[Path]:
    """A temporary path, renamed onto `out` once written. Converters print progress, warn about their own
    internals and log every tensor they skip through the root logger: one-off noise, kept out of the log."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        with atomic_file(out) as tmp, warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield tmp
    finally:
        root.setLevel(level)


def export_fp32(model_path: Path, out: Path) -> None:
    """torch model -> ONNX graph (input ids etc. -> last hidden state), batch and sequence dynamic."""
    try:
        import onnx  # noqa: F401 - the exporter needs both
        import onnxscript  # noqa: F401
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        raise OnnxUnavailable(f"exporting the encoder to ONNX needs torch, transformers, onnx and onnxscript "
                              f"(pip install 'plugsearch[onnx]'): {exc}") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tokenizer.model_input_names]
    model = AutoModel.from_pretrained(str(model_path)).eval()

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
    dynamic = tuple({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC} for _ in names)
    with _written(out) as tmp, torch.no_grad():
        torch.onnx.export(LastHidden(model), args, str(tmp), input_names=names,
                          output_names=["last_hidden_state"], dynamic_shapes={"args": dynamic},
                          opset_version=OPSET, dynamo=True, external_data=False)


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


def fuse(source: Path, out: Path) -> None:
    """onnxruntime's transformer graph fusions (layer norms with their residual add, GELU with its bias) into
    fused kernels: the same vectors, fewer and faster operators. A graph they do not match is copied as is."""
    from onnxruntime.transformers.optimizer import optimize_model

    with _written(out) as tmp:
        model = optimize_model(str(source), model_type="bert", num_heads=0, hidden_size=0)
        model.save_model_to_file(str(tmp))


def ensure_export(model_path: Path, onnx_dir: Path, *, int8: bool) -> Path:
    """The ONNX file for this model and variant: exported (once, logged) when missing, else reused."""
    folder = export_folder(onnx_dir, model_path)
    wanted = folder / (INT8 if int8 else FUSED)
    if wanted.is_file():
        logger.info("onnx encoder: reusing %s", wanted)
        return wanted
    with _export_lock(folder):
        if wanted.is_file():  # another worker exported it while this one waited
            logger.info("onnx encoder: reusing %s", wanted)
            return wanted
        fp32 = folder / FP32
        if not fp32.is_file():
            logger.info("onnx encoder: exporting %s to ONNX once (reused by later starts): %s", model_path, fp32)
            t0 = time.perf_counter()
            export_fp32(model_path, fp32)
            logger.info("onnx encoder: exported %s in %.1f s", fp32, time.perf_counter() - t0)
        if int8:
            logger.info("onnx encoder: quantizing to int8 once: %s", wanted)
            t0 = time.perf_counter()
            quantize_int8(fp32, wanted)
            logger.info("onnx encoder: quantized %s in %.1f s", wanted, time.perf_counter() - t0)
        else:
            logger.info("onnx encoder: fusing the graph's transformer operators once: %s", wanted)
            fuse(fp32, wanted)
        (folder / "export.json").write_text(json.dumps({"model": str(model_path), "format": EXPORT_FORMAT,
                                                        "opset": OPSET}, indent=2))
    return wanted


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


def session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads:
        options.intra_op_num_threads = threads
    # idle pool threads sleep instead of spinning: the service's event loop shares the cores with them
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


class OnnxModel:
    """Tokenizer + ONNX Runtime session + numpy pooling: texts -> float32 vectors."""

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
        self.session = session(self.file, settings.threads)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.dims = int(self.encode(["dimension probe"], 1, normalize=False).shape[1])

    def _forward(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if self.lower:
            texts = [t.lower() for t in texts]
        enc = self.tokenizer(texts, padding=True, truncation="longest_first",
                             max_length=self.settings.max_seq_length, return_tensors="np")
        feed = {name: np.asarray(enc[name], dtype=np.int64) for name in self.inputs}
        hidden = self.session.run(None, feed)[0]
        mask = feed["attention_mask"][:, :, None].astype(np.float32)
        if self.pooling == "cls":
            return np.asarray(hidden[:, 0], dtype=np.float32)
        if self.pooling == "max":
            return np.asarray(np.where(mask > 0, hidden, -1e9).max(axis=1), dtype=np.float32)
        summed = (hidden * mask).sum(axis=1)
        return np.asarray(summed / np.clip(mask.sum(axis=1), 1e-9, None), dtype=np.float32)

    def encode(self, texts: Sequence[str], batch_size: int, *, normalize: bool) -> npt.NDArray[np.float32]:
        """Vectors in input order; batches of similar lengths (less padding), as sentence-transformers does."""
        if not texts:
            return np.zeros((0, getattr(self, "dims", 0)), dtype=np.float32)
        batch_size = min(batch_size, MAX_CHUNK)
        order = np.argsort([-len(t) for t in texts], kind="stable")
        parts = [self._forward([texts[i] for i in order[lo:lo + batch_size]])
                 for lo in range(0, len(texts), batch_size)]
        vectors = np.empty((len(texts), parts[0].shape[1]), dtype=np.float32)
        vectors[order] = np.concatenate(parts)
        if normalize or self.model_normalizes:
            vectors /= np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)
        return np.ascontiguousarray(vectors)
