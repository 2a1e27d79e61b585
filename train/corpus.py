"""A training corpus present on every machine: the running interpreter's standard-library sources
and its pydoc topics, split into train / held-out by file, deterministically (a hash of the name).

Nothing is downloaded; the same interpreter version gives the same corpus (``fingerprint`` records it).
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5
SKIP_PARTS = {"site-packages", "__pycache__", "dist-packages"}


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier: path relative to the stdlib, or "pydoc:<topic>"
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for doc in self.train + self.heldout:
            h.update(doc.name.encode())
            h.update(hashlib.sha256(doc.text.encode()).digest())
        return h.hexdigest()[:16]


def is_heldout(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def stdlib_documents(max_file_bytes: int = 200_000) -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or path.stat().st_size > max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(str(rel), text))
    return docs


def pydoc_documents() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [Document(f"pydoc:{name}", text) for name, text in sorted(topics.items())]


def load_corpus() -> Corpus:
    docs = stdlib_documents() + pydoc_documents()
    train = [d for d in docs if not is_heldout(d.name)]
    heldout = [d for d in docs if is_heldout(d.name)]
    return Corpus(train=train, heldout=heldout)


def describe(corpus: Corpus) -> str:
    chars = sum(len(d.text) for d in corpus.train), sum(len(d.text) for d in corpus.heldout)
    return (
        f"corpus {corpus.fingerprint()} (Python {sys.version.split()[0]} stdlib + pydoc topics): "
        f"{len(corpus.train)} train files / {chars[0] / 1e6:.1f}M chars, "
        f"{len(corpus.heldout)} held-out files / {chars[1] / 1e6:.1f}M chars"
    )


def heldout_prompts(n: int, chars: int = 600) -> list[str]:
    """The opening of held-out stdlib files (never seen in training)."""
    docs = [d for d in load_corpus().heldout if not d.name.startswith("pydoc:") and len(d.text) > chars]
    return [d.text[:chars] for d in docs[:n]]
