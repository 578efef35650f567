import hashlib

import pytest

from sv_attention.data.corpus import embedded_corpus
from sv_attention.data.stories import generate_stories


def test_generates_caches_and_reuses(tmp_path):
    ec = embedded_corpus(30_000, seed=2, directory=tmp_path)
    data = ec.path.read_bytes()
    assert data == "\n\n".join(generate_stories(30_000, seed=2)).encode()
    assert ec.n_bytes == len(data) >= 30_000 and ec.sha256 == hashlib.sha256(data).hexdigest()
    assert "not comparable" in ec.description and f"{ec.n_bytes:,}" in ec.description
    mtime = ec.path.stat().st_mtime_ns
    again = embedded_corpus(30_000, seed=2, directory=tmp_path)
    assert again == ec and again.path.stat().st_mtime_ns == mtime


def test_corrupted_cache_is_regenerated_with_warning(tmp_path):
    ec = embedded_corpus(10_000, seed=0, directory=tmp_path)
    good = ec.path.read_bytes()
    ec.path.write_bytes(b"X" + good[1:])
    with pytest.warns(UserWarning, match="hash check"):
        fixed = embedded_corpus(10_000, seed=0, directory=tmp_path)
    assert fixed.path.read_bytes() == good and fixed.sha256 == ec.sha256
