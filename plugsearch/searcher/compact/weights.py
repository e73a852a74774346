"""The compact policy's folder: `weights.npz` (a few kB of numpy arrays) and `manifest.json` (how they were
trained and evaluated, their sha256, the feature names they were trained on and the search setting they were
trained in), read and checked (`read_setting`, `check_weights`, `check_feature_names`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from plugsearch.common.files import atomic_write_text, atomic_writer
from plugsearch.searcher.compact.candidates import CANDIDATE_FEATURES
from plugsearch.searcher.compact.features import DENSE, DENSE_FEATURES, DOC_FEATURES, LEXICAL
from plugsearch.searcher.policy import PolicySetting

WEIGHTS_FILE = "weights.npz"
MANIFEST_FILE = "manifest.json"
MLP_KEYS = ("mean", "std", "w1", "b1", "w2", "b2", "w3", "b3")
DENSE_PREFIX = "dense_"
"""The dense scorer's weights: `dense_mean`, ..., `dense_b3` (optional: a policy without them is lexical only)."""
QUERY_KEYS = ("qv",)


class CompactPolicyError(ValueError):
    """A compact policy folder that cannot be served (missing files, digest mismatch, wrong shapes, a
    manifest without the setting it was trained in or with a method its features cannot read)."""


def read_setting(manifest: dict[str, Any], *, has_dense: bool, encoder: str | None) -> PolicySetting | None:
    """The setting a manifest records (`search`: retrieve_k, select_k, max_turns, method, pool_methods; the
    dense encoder from `dense.encoder`), checked against what the policy's features can read; None when the
    manifest records none (a policy built in-process). Raises `CompactPolicyError` saying what is wrong."""
    recorded = manifest.get("search")
    if recorded is None:
        return None
    if not isinstance(recorded, dict):
        raise CompactPolicyError(f"the manifest's `search` must be an object, not {type(recorded).__name__}")
    if recorded.get("mode", "s3") != "s3":
        raise CompactPolicyError(f"the manifest's search mode is {recorded.get('mode')!r}: a compact policy "
                                 "searches in mode s3")
    missing = [k for k in ("retrieve_k", "select_k", "max_turns") if k not in recorded]
    if missing:
        raise CompactPolicyError(f"the manifest's `search` lacks {', '.join(missing)}: the setting the policy "
                                 "was trained in (pool size retrieve_k, documents select_k, follow-up searches "
                                 "max_turns) must travel with it")
    fields = {k: recorded[k] for k in ("retrieve_k", "select_k", "max_turns", "method", "pool_methods")
              if k in recorded}
    fields.setdefault("method", LEXICAL)
    fields.setdefault("pool_methods", [LEXICAL, DENSE] if has_dense else [LEXICAL])
    try:
        setting = PolicySetting(**fields, encoder=encoder)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise CompactPolicyError(f"the manifest's `search` setting is invalid ({problems})") from exc
    if setting.method != LEXICAL:
        raise CompactPolicyError(f"the manifest's follow-up method is {setting.method!r}: the compact policy's "
                                 f"features read BM25 evidence, so its follow-up searches must be {LEXICAL!r}")
    pool = setting.pool_methods or []
    if pool[0] != LEXICAL or len(set(pool)) != len(pool) or not set(pool) <= {LEXICAL, DENSE}:
        raise CompactPolicyError(f"the manifest's pool_methods {pool} cannot be served: a compact policy's pool "
                                 f"is {LEXICAL!r} first, optionally followed by {DENSE!r}")
    if DENSE in pool and not has_dense:
        raise CompactPolicyError("the manifest's pool has a dense block but the weights have no dense scorer")
    if DENSE in pool and not encoder:
        raise CompactPolicyError("the manifest's pool has a dense block but names no encoder (dense.encoder): "
                                 "cosines of another encoder would not fit the dense scorer")
    return setting


def _same_encoder(served: str, trained: str | None) -> bool:
    """The retriever's encoder (a name or a local path) is the one the dense scorer was trained with."""
    if not trained:
        return False
    return served == trained or Path(served.rstrip("/")).name == Path(trained.rstrip("/")).name



FEATURE_NAMES = {"doc_features": DOC_FEATURES, "candidate_features": CANDIDATE_FEATURES,
                 "dense_features": DENSE_FEATURES}
"""The manifest's record of each feature row, by the names this code builds it with, in its order."""


def has_dense_scorer(weights: dict[str, np.ndarray]) -> bool:
    return DENSE_PREFIX + "w1" in weights


def check_weights(weights: dict[str, np.ndarray]) -> None:
    """Every array the policy reads is there (the dense scorer whole or not at all) and shaped for the features
    this code computes. Raises `CompactPolicyError`."""
    missing = [k for k in (*MLP_KEYS, *QUERY_KEYS) if k not in weights]
    if missing:
        raise CompactPolicyError(f"compact policy weights lack {missing}")
    dense = [k for k in MLP_KEYS if DENSE_PREFIX + k in weights]
    if dense and len(dense) != len(MLP_KEYS):
        raise CompactPolicyError(f"compact policy weights have part of the dense scorer ({dense})")
    w = weights
    for prefix, n in (("", len(DOC_FEATURES)), (DENSE_PREFIX, len(DOC_FEATURES) + len(DENSE_FEATURES))):
        if prefix and not dense:
            continue
        shapes = w[prefix + "mean"].shape, w[prefix + "std"].shape, w[prefix + "w1"].shape[0]
        if shapes != ((n,), (n,), n):
            raise CompactPolicyError(f"compact policy {prefix or 'lexical_'}scorer weights are for "
                                     f"{w[prefix + 'w1'].shape[0]} document features, this code computes {n}")
    if w["qv"].shape != (len(CANDIDATE_FEATURES),):
        raise CompactPolicyError(f"compact policy query weights are for {w['qv'].shape} candidate features, "
                                 f"this code computes {len(CANDIDATE_FEATURES)}")


def check_feature_names(manifest: dict[str, Any], *, dense: bool) -> None:
    """The feature rows the weights were trained on, as the manifest names them, are this code's, name for name
    and in order (`dense_features` only with the dense scorer): a row of the same length in another order would
    feed each weight another feature. Raises `CompactPolicyError` naming the rows and the positions that differ."""
    problems = []
    for key, names in FEATURE_NAMES.items():
        if key == "dense_features" and not dense:
            continue
        recorded = manifest.get(key)
        if not isinstance(recorded, list):
            problems.append(f"`{key}` is not recorded (the names of the features the weights were trained on)")
            continue
        if recorded == list(names):
            continue
        differ = [f"{i}: {a!r} (code {b!r})" for i, (a, b) in enumerate(zip(recorded, names, strict=False)) if a != b]
        if len(recorded) != len(names):
            extra, lacking = [n for n in recorded if n not in names], [n for n in names if n not in recorded]
            differ.append(f"{len(recorded)} names, the code builds {len(names)}" +
                          (f"; not in the code: {', '.join(extra)}" if extra else "") +
                          (f"; not in the manifest: {', '.join(lacking)}" if lacking else ""))
        problems.append(f"`{key}` differs from the code's at {'; '.join(differ[:8])}"
                        + (f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""))
    if problems:
        raise CompactPolicyError("the weights were trained on other features than this code computes: "
                                 + "; ".join(problems))


def read_folder(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], str]:
    """(weights, manifest, digest) of a policy folder, the weights' sha256 checked against the manifest's, their
    shapes and the manifest's feature names against this code's. Raises `CompactPolicyError` saying what is
    wrong, with the file."""
    manifest_path, weights_path = folder / MANIFEST_FILE, folder / WEIGHTS_FILE
    if not manifest_path.is_file() or not weights_path.is_file():
        raise CompactPolicyError(f"{folder} is not a compact policy folder (needs {MANIFEST_FILE} and "
                                 f"{WEIGHTS_FILE})")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CompactPolicyError(f"{manifest_path}: not JSON ({exc})") from exc
    data = weights_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if manifest.get("weights_sha256") != digest:
        raise CompactPolicyError(f"{weights_path}: sha256 {digest} does not match the manifest's "
                                 f"{manifest.get('weights_sha256')}")
    with np.load(weights_path) as npz:
        weights = {k: np.asarray(npz[k], dtype=np.float32) for k in npz.files}
    check_weights(weights)
    try:
        check_feature_names(manifest, dense=has_dense_scorer(weights))
    except CompactPolicyError as exc:
        raise CompactPolicyError(f"{manifest_path}: {exc}") from exc
    return weights, manifest, digest


def write_folder(folder: Path, weights: dict[str, np.ndarray], manifest: dict[str, Any]
                 ) -> tuple[Path, str, dict[str, Any]]:
    """Write `weights.npz` and `manifest.json` (with the weights' digest and this code's feature names) into
    `folder`: (the weights' path, their digest, the manifest written)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WEIGHTS_FILE
    arrays: dict[str, Any] = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    with atomic_writer(path) as fh:  # the weights whole, then the manifest that names their digest
        np.savez(fh, **arrays)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = {**manifest, "weights_sha256": digest,
                **{key: list(names) for key, names in FEATURE_NAMES.items()
                   if key != "dense_features" or has_dense_scorer(weights)}}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    return path, digest, manifest
