"""The embedded corpus: procedurally generated stories, generated once and cached on disk.

The text is never committed; it is regenerated deterministically from ``(GENERATOR_VERSION, seed,
n_bytes)`` and cached at ``$SV_ATTENTION_CACHE`` (default ``~/.cache/sv_attention``). The cache file's
SHA-256 is checked against a fresh hash on every load, and a corrupted cache is regenerated (with a
warning, never silently).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from sv_attention.data.stories import GENERATOR_VERSION, generate_stories

CACHE_ENV = "SV_ATTENTION_CACHE"
DEFAULT_EMBEDDED_BYTES = 4_000_000
"""Default size of the embedded corpus (4 MB of text)."""

SEPARATOR = "\n\n"

DESCRIPTION = (
    "embedded: procedurally generated TinyStories-like English children's stories (sv_attention.data.stories, "
    "generator v{version}, seed {seed}, {n_bytes:,} bytes, {n_docs:,} stories joined by blank lines). A small "
    "grammar of characters, places, problems and endings with consistent names and pronouns; a vocabulary of "
    "a few hundred words, so bits-per-byte on it is far below what natural text gives and is not comparable "
    "to enwik8 or real TinyStories."
)


@dataclass(frozen=True)
class EmbeddedCorpus:
    """What :func:`embedded_corpus` produced.

    Attributes
    ----------
    path : Path
        The cached UTF-8 text file.
    seed, n_bytes_requested, n_bytes, n_docs, generator_version : int
        How it was generated and its exact size.
    sha256 : str
        Hash of the file's bytes.
    description : str
        One paragraph saying exactly what the corpus is (used in run logs and the model card).
    """

    path: Path
    seed: int
    n_bytes_requested: int
    n_bytes: int
    n_docs: int
    generator_version: int
    sha256: str
    description: str

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def cache_dir() -> Path:
    """``$SV_ATTENTION_CACHE`` or ``~/.cache/sv_attention``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "sv_attention"


def embedded_corpus(n_bytes: int = DEFAULT_EMBEDDED_BYTES, seed: int = 0,
                    directory: str | os.PathLike | None = None) -> EmbeddedCorpus:
    """Generate (or reuse from the cache) the embedded story corpus.

    Parameters
    ----------
    n_bytes : int
        Minimum size in bytes (the last story is kept whole, so the text is slightly longer).
    seed : int
        Corpus seed.
    directory : path, optional
        Cache directory (default :func:`cache_dir`).

    Returns
    -------
    EmbeddedCorpus
    """
    stories = None
    d = Path(directory) if directory is not None else cache_dir()
    path = d / f"embedded_stories_v{GENERATOR_VERSION}_seed{seed}_{n_bytes}.txt"
    meta = path.with_suffix(".sha256")
    if path.exists() and meta.exists():
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        stored = meta.read_text().split()
        if stored and stored[0] == digest:
            n_docs = int(stored[1]) if len(stored) > 1 else data.count(SEPARATOR.encode()) + 1
            return _make(path, seed, n_bytes, data, n_docs, digest)
        warnings.warn(f"embedded corpus cache {path} failed its hash check; regenerating it.", stacklevel=2)
    stories = generate_stories(n_bytes, seed=seed)
    data = SEPARATOR.join(stories).encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    d.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    meta.write_text(f"{digest} {len(stories)}\n")
    return _make(path, seed, n_bytes, data, len(stories), digest)


def _make(path: Path, seed: int, n_bytes: int, data: bytes, n_docs: int, digest: str) -> EmbeddedCorpus:
    return EmbeddedCorpus(
        path=path, seed=seed, n_bytes_requested=n_bytes, n_bytes=len(data), n_docs=n_docs,
        generator_version=GENERATOR_VERSION, sha256=digest,
        description=DESCRIPTION.format(version=GENERATOR_VERSION, seed=seed, n_bytes=len(data), n_docs=n_docs),
    )
