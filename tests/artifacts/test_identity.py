"""Streaming sha256, the digest cache, progress on large files, the vocabulary digest."""

import hashlib
import io
import os

from power_core.artifacts import ArtifactView, file_digest, identity, sha256_file, vocab_digest


def test_digest_matches_hashlib_and_second_run_hits_cache(fx):
    p = fx["dflash"]
    want = hashlib.sha256(p.read_bytes()).hexdigest()
    first = file_digest(p)
    assert first.sha256 == want and not first.cached
    hits = identity.STATS["cache_hits"]
    second = file_digest(p)
    assert second.sha256 == want and second.cached
    assert identity.STATS["cache_hits"] == hits + 1
    assert any(identity.cache_dir().glob("*.json"))


def test_cache_misses_when_the_file_changes(fx):
    p = fx["dflash"]
    a = file_digest(p)
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    b = file_digest(p)
    assert not b.cached and b.sha256 == a.sha256
    with open(p, "ab") as f:
        f.write(b"x")
    c = file_digest(p)
    assert not c.cached and c.sha256 != a.sha256


def test_corrupt_cache_entry_is_ignored(fx):
    p = fx["dspark"]
    file_digest(p)
    for entry in identity.cache_dir().glob("*.json"):
        entry.write_text("{not json")
    again = file_digest(p)
    assert not again.cached and again.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()


def test_hashing_1gb_sparse_file_shows_progress_then_hits_cache(tmp_path):
    from rich.console import Console

    p = tmp_path / "big.bin"
    with open(p, "wb") as f:
        f.write(b"head")
        f.truncate(1 << 30)
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    hashed = identity.STATS["hashed"]
    d1 = file_digest(p, progress=True, console=console)
    out = buf.getvalue()
    assert "sha256" in out and "big.bin" in out and "1.1 GB" in out  # rich's final bar: 1.1/1.1 GB
    assert not d1.cached and identity.STATS["hashed"] == hashed + 1
    buf2 = io.StringIO()
    d2 = file_digest(p, progress=True, console=Console(file=buf2, force_terminal=True))
    assert d2.cached and d2.sha256 == d1.sha256
    assert identity.STATS["hashed"] == hashed + 1  # not hashed again
    assert buf2.getvalue() == ""  # no bar for a cache hit


def test_progress_auto_only_on_a_terminal(fx, monkeypatch):
    assert identity._progress_wanted(None, 10 << 30) is False or os.isatty(2)
    assert identity._progress_wanted(None, 10) is False
    assert identity._progress_wanted(True, 10) is True


def test_sha256_file_helper(fx):
    assert sha256_file(fx["target_plain"]) == hashlib.sha256(fx["target_plain"].read_bytes()).hexdigest()


def test_vocab_digest_ignores_everything_but_the_vocabulary(fx):
    a = ArtifactView.from_gguf(fx["target_mtp"]).vocab
    b = ArtifactView.from_gguf(fx["target_plain"]).vocab
    c = ArtifactView.from_gguf(fx["dflash"]).vocab  # adds a mask id
    assert vocab_digest(a) == vocab_digest(b)
    assert vocab_digest(a) != vocab_digest(c)
    assert len(vocab_digest(None)) == 64
