"""Fuzzing inspection + every validator: random mutations, truncations and header lies.

Only typed errors (ArtifactError) may escape; each file is decided quickly with bounded memory.
"""

import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power_core.artifacts import ArtifactView, compare_vocab, synthetic
from power_core.artifacts.contracts import classify_draft
from power_core.errors import ArtifactError


def _validators():
    out = []
    for mod, fn in (("power_mtp", "validate_mtp"), ("power_dflash", "validate_dflash"),
                    ("power_dflash2", "validate_dflash2"), ("power_dspark", "validate_dspark")):
        try:
            m = __import__(mod)
        except ImportError:
            continue
        out.append(getattr(m, fn))
    return out


VALIDATORS = _validators()


class _Sources:
    """Valid blobs plus a parsed target (a plain object, so hypothesis does not print the bytes)."""

    def __init__(self, d: Path) -> None:
        fx = synthetic.write_fixture_set(d)
        self.blobs = {k: Path(v).read_bytes() for k, v in fx.items()}
        self.target = ArtifactView.from_gguf(fx["target_plain"])

    def __repr__(self) -> str:
        return "<fuzz sources>"


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    return _Sources(tmp_path_factory.mktemp("fuzzsrc"))


def _decide(path: Path, target: ArtifactView) -> None:
    try:
        view = ArtifactView.from_gguf(path)
    except ArtifactError:
        return
    for validate in VALIDATORS:
        for t, d in ((view, None), (target, view), (view, target)):
            try:
                validate(t, d, None)
            except ArtifactError:
                pass
    for t, d in ((target, view), (view, target)):
        try:
            compare_vocab(t, d)
        except ArtifactError:
            pass
    try:
        classify_draft(view)
    except ArtifactError:
        pass


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("u64"), st.floats(0, 1), st.sampled_from([0, 1, 2**31, 2**32 + 1, 2**40, 2**63, 2**64 - 1])),
    st.tuples(st.just("u32"), st.floats(0, 1), st.sampled_from([0, 1, 7, 9, 12, 13, 99, 2**31, 2**32 - 1])),
    st.tuples(st.just("header_u64"), st.sampled_from([8, 16]), st.integers(0, 2**64 - 1)),
)


def _apply(blob: bytes, muts) -> bytes:
    b = bytearray(blob)
    for kind, *arg in muts:
        if not b:
            break
        header_end = min(len(b), 8192)  # bias lies towards the header, where counts and lengths live
        if kind == "truncate":
            del b[int(arg[0] * len(b)):]
        elif kind == "flip":
            for pos, val in arg[0]:
                b[int(pos * (header_end - 1))] = val
        elif kind in ("u64", "u32"):
            n = 8 if kind == "u64" else 4
            if header_end > n:
                at = int(arg[0] * (header_end - n))
                b[at:at + n] = struct.pack("<Q" if n == 8 else "<I", arg[1])
        elif kind == "header_u64" and len(b) >= arg[0] + 8:
            b[arg[0]:arg[0] + 8] = struct.pack("<Q", arg[1])
    return bytes(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(role=st.sampled_from(["target_mtp", "target_plain", "dflash", "dflash2", "dspark", "dspark_conf"]),
       muts=st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_only_typed_errors_fast_bounded(blobs, tmp_path_factory, role, muts):
    target = blobs.target
    data = _apply(blobs.blobs[role], muts)
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _decide(path, target)  # anything but ArtifactError propagates and fails the test
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0, (role, muts, elapsed)
    assert peak < 64 << 20, (role, muts, peak)
