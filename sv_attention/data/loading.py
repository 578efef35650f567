"""Load a training corpus as bytes and split it contiguously into train / validation.

``--dataset`` accepts

``embedded``
    the generated story corpus (:mod:`sv_attention.data.corpus`), the default;
local text files
    a file, a directory (every ``*.txt`` inside, sorted) or a glob, read through ``datasets``' ``text``
    builder with ``sample_by="document"`` (one document per file, newlines kept);
a Hub dataset name
    ``owner/name`` (optionally ``--dataset-config`` / ``--dataset-split``), streamed through
    ``datasets.load_dataset`` when the network is reachable; the ``text`` column (``--text-column``) of
    each row is one document.

Documents are joined with a blank line and encoded as UTF-8: the model is byte-level (vocabulary 256).
The split is contiguous: the first ``1 - val_fraction`` of the bytes train, the tail validates, and both
ranges and their SHA-256 hashes are recorded so the hold-out can be checked later.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sv_attention.errors import InvalidInputError, NetworkUnavailableError

SEPARATOR = "\n\n"


@dataclass
class ByteCorpus:
    """A corpus as one byte array plus a record of where it came from.

    Attributes
    ----------
    data : np.ndarray
        ``[n_bytes]`` uint8.
    source : dict
        JSON-able description: kind (embedded / local / hub), name, files or generator settings,
        sha256, n_bytes, n_docs, description.
    """

    data: np.ndarray
    source: dict[str, Any] = field(default_factory=dict)


@dataclass
class CorpusSplit:
    """A contiguous train / validation split of a :class:`ByteCorpus`.

    Attributes
    ----------
    train, validation : np.ndarray
        ``[n_train]`` and ``[n_val]`` uint8 views, ``train`` = bytes ``[0, n_train)``,
        ``validation`` = bytes ``[n_train, n_bytes)``.
    info : dict
        The recorded split: byte ranges, sizes, SHA-256 of each part, ``val_fraction`` and the source.
    """

    train: np.ndarray
    validation: np.ndarray
    info: dict[str, Any]


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def _local_files(spec: str) -> list[str] | None:
    p = Path(spec).expanduser()
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*.txt") if f.is_file())
        if not files:
            raise InvalidInputError(f"directory {spec!r} holds no *.txt files; point --dataset at text files.")
        return files
    if any(c in spec for c in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(f))
        if not files:
            raise InvalidInputError(f"the glob {spec!r} matches no files.")
        return files
    return None


def _join(docs: list[str]) -> bytes:
    return SEPARATOR.join(docs).encode("utf-8")


def _load_local(files: list[str]) -> tuple[bytes, int]:
    import datasets

    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
    docs = [t for t in ds["text"] if t]
    return _join(docs), len(docs)


def _load_hub(name: str, config: str | None, split: str, text_column: str, max_bytes: int | None) -> tuple[bytes, int]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        docs: list[str] = []
        total = 0
        for row in ds:
            if text_column not in row:
                raise InvalidInputError(
                    f"dataset {name!r} has no column {text_column!r} (columns: {sorted(row)}); "
                    "pass --text-column.")
            t = row[text_column]
            if not t:
                continue
            docs.append(t)
            total += len(t.encode("utf-8")) + len(SEPARATOR)
            if max_bytes is not None and total >= max_bytes:
                break
    except InvalidInputError:
        raise
    except Exception as exc:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        cls = NetworkUnavailableError if (offline or isinstance(exc, (ConnectionError, OSError))) else InvalidInputError
        raise cls(
            f"could not load Hub dataset {name!r} ({type(exc).__name__}: {exc}). Without network access use "
            "--dataset embedded or --dataset PATH_TO_TEXT_FILES.") from exc
    if not docs:
        raise InvalidInputError(f"Hub dataset {name!r} split {split!r} yielded no text.")
    return _join(docs), len(docs)


def load_corpus(dataset: str = "embedded", *, embedded_bytes: int | None = None, seed: int = 0,
                dataset_config: str | None = None, dataset_split: str = "train", text_column: str = "text",
                max_bytes: int | None = None) -> ByteCorpus:
    """Load ``dataset`` as bytes (see the module docstring for what ``dataset`` may be).

    Parameters
    ----------
    dataset : str
        ``"embedded"``, a local file / directory / glob, or a Hub dataset name.
    embedded_bytes : int, optional
        Size of the embedded corpus (default :data:`sv_attention.data.corpus.DEFAULT_EMBEDDED_BYTES`).
    seed : int
        Seed of the embedded corpus.
    dataset_config, dataset_split, text_column : str
        Hub dataset configuration, split and text column.
    max_bytes : int, optional
        Truncate the corpus to its first ``max_bytes`` bytes (Hub datasets stop streaming there).

    Returns
    -------
    ByteCorpus
    """
    from sv_attention.data.corpus import DEFAULT_EMBEDDED_BYTES, embedded_corpus

    if not isinstance(dataset, str) or not dataset:
        raise InvalidInputError(f"dataset must be a non-empty string, got {dataset!r}.")
    if max_bytes is not None and max_bytes <= 0:
        raise InvalidInputError(f"max_bytes must be positive, got {max_bytes}.")
    if dataset == "embedded":
        ec = embedded_corpus(embedded_bytes or DEFAULT_EMBEDDED_BYTES, seed=seed)
        raw = ec.path.read_bytes()
        source = {"kind": "embedded", "name": "embedded", **ec.to_json()}
        n_docs = ec.n_docs
    else:
        files = _local_files(dataset)
        if files is not None:
            raw, n_docs = _load_local(files)
            source = {"kind": "local", "name": dataset, "files": files,
                      "description": f"local text files ({len(files)} file(s)) read with datasets' text builder"}
        else:
            if Path(dataset).suffix or dataset.startswith((".", "/", "~")):
                raise InvalidInputError(
                    f"{dataset!r} looks like a path but no such file or directory exists; "
                    "give an existing text file, a directory of *.txt files, a glob, a Hub name or 'embedded'.")
            raw, n_docs = _load_hub(dataset, dataset_config, dataset_split, text_column, max_bytes)
            source = {"kind": "hub", "name": dataset, "config": dataset_config, "split": dataset_split,
                      "text_column": text_column, "description": f"Hub dataset {dataset} ({dataset_split})"}
    if max_bytes is not None:
        raw = raw[:max_bytes]
    data = np.frombuffer(raw, dtype=np.uint8)
    if data.size == 0:
        raise InvalidInputError(f"dataset {dataset!r} is empty.")
    source.update({"n_bytes": int(data.size), "n_docs": int(n_docs), "sha256": _sha(data)})
    return ByteCorpus(data=data, source=source)


def split_contiguous(corpus: ByteCorpus, val_fraction: float = 0.05, min_val_bytes: int = 0) -> CorpusSplit:
    """Split ``corpus`` into a training head and a validation tail.

    Parameters
    ----------
    corpus : ByteCorpus
    val_fraction : float
        Fraction of bytes held out, in (0, 0.5].
    min_val_bytes : int
        The validation tail must hold at least this many bytes (e.g. one eval window + 1).

    Returns
    -------
    CorpusSplit
    """
    if not (0.0 < val_fraction <= 0.5):
        raise InvalidInputError(f"val_fraction must be in (0, 0.5], got {val_fraction}.")
    n = int(corpus.data.size)
    n_val = max(int(round(n * val_fraction)), 1)
    n_train = n - n_val
    if n_val < min_val_bytes or n_train < min_val_bytes:
        raise InvalidInputError(
            f"corpus of {n} bytes is too small: the split gives {n_train} train / {n_val} validation bytes and "
            f"each needs at least {min_val_bytes}; use more text, a larger --val-fraction or a smaller --block-size.")
    train, val = corpus.data[:n_train], corpus.data[n_train:]
    info = {
        "kind": "contiguous",
        "val_fraction": val_fraction,
        "n_bytes": n,
        "train": {"start": 0, "end": n_train, "n_bytes": n_train, "sha256": _sha(train)},
        "validation": {"start": n_train, "end": n, "n_bytes": n_val, "sha256": _sha(val)},
        "source": corpus.source,
    }
    return CorpusSplit(train=train, validation=val, info=info)
