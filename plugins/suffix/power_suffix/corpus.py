"""The suffix memory's static corpus: the files it reads (:func:`corpus_files`) and their tokens as one index
(:func:`corpus_index`), built once and never evicted (``spec_suffix_corpus``: a codebase, docs)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from power_core.errors import ConfigError
from power_core.logs import get_logger
from power_suffix.index import SEPARATOR, SuffixIndex

__all__ = ["CORPUS_FILE_MAX", "corpus_files", "corpus_index"]

log = get_logger(__name__)

#: corpus files larger than this are skipped (with a log line): a corpus is text, not data
CORPUS_FILE_MAX = 16 << 20
_TEXT_SUFFIXES_SKIPPED = frozenset({".png", ".jpg", ".jpeg", ".gif", ".pdf", ".zip", ".gz", ".bz2", ".xz", ".so",
                                    ".o", ".a", ".pyc", ".bin", ".gguf", ".safetensors", ".whl", ".tar"})


def corpus_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files of ``paths`` (files, or directories walked in name order, hidden entries skipped),
    or :class:`ConfigError` naming ``spec_suffix_corpus`` for a path that does not exist."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                out.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
        else:
            raise ConfigError("spec_suffix_corpus", str(raw), "existing files or directories")
    return [f for f in out if f.suffix.lower() not in _TEXT_SUFFIXES_SKIPPED]


def corpus_index(paths: Sequence[str | os.PathLike[str]], encode: Callable[[str], np.ndarray], lengths: tuple[int, ...],
                 *, progress: bool = True) -> tuple[SuffixIndex, int]:
    """The files of ``paths`` (:func:`corpus_files`) tokenized with ``encode`` into one index hashing suffixes
    of ``lengths`` (one document per file; an unreadable or too large file is skipped with a log line), with a
    progress bar on a terminal; and the tokens it holds."""
    files = corpus_files(paths)
    added = 0
    index = SuffixIndex(lengths, truncatable=False)
    with _progress(progress, len(files)) as advance:
        for f in files:
            try:
                if f.stat().st_size > CORPUS_FILE_MAX:
                    log.warning("suffix.corpus_skipped", path=str(f), reason="larger than 16 MiB")
                    continue
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                log.warning("suffix.corpus_skipped", path=str(f), reason=f"{type(exc).__name__}: {exc}")
                continue
            finally:
                advance()
            ids = np.asarray(encode(text), dtype=np.int32).ravel()
            if ids.shape[0] < 2:
                continue
            index.extend(ids)
            index.extend([SEPARATOR])
            added += int(ids.shape[0])
    return index, added


class _progress:
    """A rich progress bar over ``total`` files when asked and on a terminal; else nothing."""

    def __init__(self, show: bool, total: int) -> None:
        self.show, self.total = show, total
        self._bar: object | None = None

    def __enter__(self) -> Callable[[], None]:
        import sys

        if not self.show or not sys.stderr.isatty() or self.total == 0:
            return lambda: None
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("suffix corpus", total=self.total)
        self._bar = bar
        return lambda: bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        from rich.progress import Progress

        if isinstance(self._bar, Progress):
            self._bar.stop()
