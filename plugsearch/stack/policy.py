"""Which search policy the stack serves: a compact policy (`--policy compact` or a folder), the trained
SmolLM2 searcher, or the untrained base model (`auto` picks by their recorded evaluations); and a compact
policy bound to a corpus is refused on another one before anything starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from plugsearch.searcher.compact import CompactPolicy, CompactPolicyError
from plugsearch.searcher.policy_corpus import CorpusMismatch, bound_corpus, check_corpus
from plugsearch.searcher.trained import COMPACT_DIR, LORA_DIR, TrainedSearcher, TrainedSearcherError
from plugsearch.stack import StackError

POLICY_CHOICES = ("auto", "compact", "trained", "base")


def _compact_policy(args: argparse.Namespace, say: Callable[[str], None], folder: Path | None = None
                    ) -> CompactPolicy | None:
    """The compact policy for `--policy compact` or `--policy DIR`, or `auto` when its recorded evaluation beat
    naive top-k."""
    if args.policy not in POLICY_CHOICES:
        try:
            policy = CompactPolicy.load(Path(args.policy))
        except CompactPolicyError as exc:
            raise StackError(f"--policy {args.policy}: {exc}") from exc
        evaluation = policy.manifest.get("evaluation") or {}
        verdict = evaluation.get("beats_naive")
        say(f"policy: the compact searcher {policy.model} from {args.policy} "
            f"({evaluation.get('summary', 'no recorded evaluation')}; beats_naive: {verdict})")
        return policy
    if args.policy not in ("auto", "compact"):
        return None
    folder = folder or COMPACT_DIR
    if args.policy == "auto" and not (folder / "manifest.json").is_file():
        return None
    try:
        policy = CompactPolicy.load(folder)
    except CompactPolicyError as exc:
        raise StackError(f"{exc} (pass --policy base to serve the untrained LLM policy)") from exc
    if args.policy == "auto" and not (policy.manifest.get("evaluation") or {}).get("beats_naive"):
        say("policy: the compact searcher is shipped but did not beat naive top-k in its recorded evaluation "
            "(--policy compact serves it anyway)")
        return None
    evaluation = policy.manifest.get("evaluation") or {}
    say(f"policy: the compact searcher {policy.model} ({evaluation.get('summary', 'see its manifest')})")
    return policy


def _trained_policy(args: argparse.Namespace, say: Callable[[str], None], folder: Path | None = None
                    ) -> TrainedSearcher | None:
    """The trained searcher when `--policy trained` can serve it here; says why when it cannot."""
    if args.policy == "base":
        say("policy: the untrained SmolLM2 (--policy base)")
        return None
    if args.llm_url is not None:
        say("policy: the model at --llm-url (the trained adapter is for the embedded SmolLM2 only)")
        return None
    folder = folder or LORA_DIR
    if args.policy == "auto" and not TrainedSearcher.shipped(folder):
        say("policy: the untrained SmolLM2 (no trained searcher is shipped in plugsearch/searcher/trained)")
        return None
    try:
        trained = TrainedSearcher.load(folder)
        from plugsearch.common.llama_server import smollm2_gguf_path

        trained.check_base(smollm2_gguf_path())
    except TrainedSearcherError as exc:
        raise StackError(f"{exc} (pass --policy base to serve the untrained model)") from exc
    if args.policy == "auto" and not trained.serve_by_default:
        say("policy: the untrained SmolLM2 (the shipped trained searcher did not beat it in its recorded "
            "evaluation; --policy trained serves it anyway)")
        return None
    say(f"policy: the trained searcher ({trained.folder.name}: {trained.manifest.get('summary', 'see its manifest')})")
    return trained


def check_policy_corpus(compact: CompactPolicy | None, corpus: Path, dense: bool,
                        environ: Mapping[str, str] | None = None) -> None:
    """A compact policy bound to the corpus it was trained on (`plugsearch.searcher.policy_corpus`) is served on
    that corpus, with its dense encoder and index type, or refused here, before anything starts."""
    if compact is None or bound_corpus(compact.manifest) is None:
        return
    from plugsearch.retriever.settings import DEFAULT_ENCODER
    from plugsearch.retriever.store.corpus import file_checksum

    environ = os.environ if environ is None else environ
    encoder = environ.get("RETRIEVER_ENCODER__NAME") or DEFAULT_ENCODER
    try:
        check_corpus(compact.manifest, corpus_sha256=file_checksum(corpus), encoder=encoder if dense else None,
                     dense_index="flat" if dense else None, name=f"the compact policy {compact.model}")
    except CorpusMismatch as exc:
        raise StackError(str(exc)) from exc


def serve_dense(setting: str, compact: CompactPolicy | None) -> bool:
    """`--dense`: on, off, or auto: when the served compact policy scores a dense pool."""
    return setting == "on" or (setting == "auto" and compact is not None and compact.has_dense)
