"""The adapter guide's method-by-method examples run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "adapter-guide.md"


def test_adapter_guide_examples_run():
    blocks = re.findall(r"<!-- runnable -->\n```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 6
    namespace: dict[str, object] = {"__name__": "adapter_guide"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name}[runnable {i}]", "exec"), namespace)  # noqa: S102
