import hashlib

import numpy as np
import pytest

from sv_attention.data.loading import ByteCorpus, load_corpus, split_contiguous
from sv_attention.errors import InvalidInputError, NetworkUnavailableError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path / "cache"))


def test_embedded_bytes_and_record():
    c = load_corpus("embedded", embedded_bytes=20_000, seed=0)
    assert c.data.dtype == np.uint8 and c.data.size >= 20_000
    assert c.source["kind"] == "embedded" and c.source["sha256"] == hashlib.sha256(c.data.tobytes()).hexdigest()


def test_local_files_keep_text_exactly(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("Hello\nworld\n\nthird line")
    (d / "b.txt").write_text("Second file, caf\u00e9\n")
    expected = "Hello\nworld\n\nthird line\n\nSecond file, caf\u00e9\n".encode()
    for spec in (str(d), str(d / "*.txt")):
        c = load_corpus(spec)
        assert c.data.tobytes() == expected and c.source["kind"] == "local" and c.source["n_docs"] == 2
    single = load_corpus(str(d / "a.txt"), max_bytes=5)
    assert single.data.tobytes() == b"Hello"


def test_bad_specs_raise(tmp_path):
    with pytest.raises(InvalidInputError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="no \\*.txt"):
        load_corpus(str(tmp_path / "empty"))
    with pytest.raises(InvalidInputError, match="non-empty"):
        load_corpus("")


def test_hub_offline_is_a_clear_network_error(monkeypatch):
    import datasets
    import huggingface_hub.constants as hc

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(NetworkUnavailableError, match="--dataset embedded"):
        load_corpus("someone/some-dataset")


def test_contiguous_split_is_recorded_and_checkable():
    data = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8)
    s = split_contiguous(ByteCorpus(data=data, source={"kind": "test"}), val_fraction=0.25)
    assert s.train.size == 768 and s.validation.size == 256
    assert np.array_equal(np.concatenate([s.train, s.validation]), data)
    info = s.info
    assert info["train"] == {"start": 0, "end": 768, "n_bytes": 768,
                             "sha256": hashlib.sha256(data[:768].tobytes()).hexdigest()}
    assert info["validation"]["start"] == 768 and info["validation"]["end"] == 1024
    assert info["validation"]["sha256"] == hashlib.sha256(data[768:].tobytes()).hexdigest()


def test_split_errors():
    c = ByteCorpus(data=np.zeros(100, dtype=np.uint8))
    with pytest.raises(InvalidInputError, match="val_fraction"):
        split_contiguous(c, 0.0)
    with pytest.raises(InvalidInputError, match="too small"):
        split_contiguous(c, 0.1, min_val_bytes=20)


def test_hub_rows_are_streamed_until_max_bytes(monkeypatch):
    import datasets

    seen = {}

    def fake_load(name, config=None, split=None, streaming=False):
        seen.update(name=name, config=config, split=split, streaming=streaming)
        return iter([{"text": "first doc"}, {"text": ""}, {"text": "second doc"}, {"text": "never read"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    c = load_corpus("org/stories", dataset_config="en", dataset_split="validation", max_bytes=15)
    assert seen == {"name": "org/stories", "config": "en", "split": "validation", "streaming": True}
    assert c.data.tobytes() == b"first doc\n\nseco" and c.source["kind"] == "hub" and c.source["n_docs"] == 2
    with pytest.raises(InvalidInputError, match="--text-column"):
        load_corpus("org/stories", text_column="body")
