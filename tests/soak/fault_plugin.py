"""A third-party plugin for the chaos soak (``tests/soak/soak.py``): faults inside a real ``power serve``.

It is not imported by the tests' own process. The soak copies this file as ``power_soak_faults.py``
into a directory of its own, next to a ``power_soak_faults-0.1.dist-info`` whose ``entry_points.txt``
names it in Power's entry-point group (``power.adapters``), and starts ``power serve`` with that
directory on ``PYTHONPATH``: the server finds it as it finds any installed plugin
(:func:`power_core.plugins.build_plugins`), with nothing installed into the environment and no switch
in the product. What it does, and how often, is read from ``soak_faults.json`` next to it:

* ``power_request_end`` / ``power_request_start`` observers that raise (``observer_raise``) or sleep
  (``observer_sleep``, ``observer_sleep_s`` seconds): Power counts and contains them;
* a shared target pass that raises before it decodes (``pass_fault``): llama.cpp's
  ``LlamaBatch.decode_batch`` patched, as ``tests/test_faults.py`` patches a runtime's methods;
* a target restore that fails (the ``restore_fault_at``-th restore of the process, once: its
  sequence is lost, the server serves on with the others);
* a proposer restore that fails (``proposer_restore_fault``: the suffix proposer's ``restore``).

Nothing is injected until the soak creates ``armed`` next to it (after the solo runs, which must be
undisturbed). Each injected fault is written to stderr as ``power-soak-fault: KIND``, which the soak
counts.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from power_core.errors import RuntimeFault
from power_core.spec import hookimpl

CONFIG: dict[str, Any] = {"seed": 0, "observer_raise": 0.0, "observer_sleep": 0.0, "observer_sleep_s": 0.2,
                          "pass_fault": 0.0, "restore_fault_at": 0, "proposer_restore_fault": 0.0}
_path = Path(__file__).with_name("soak_faults.json")
_ARMED = Path(__file__).with_name("armed")
if _path.exists():
    CONFIG.update(json.loads(_path.read_text()))
_rng = random.Random(CONFIG["seed"] * 1_000_003 + os.getpid())
_lock = threading.Lock()
_restores = 0


def _roll(rate: float) -> bool:
    if rate <= 0 or not _ARMED.exists():
        return False
    with _lock:
        return rate > 0 and _rng.random() < rate


def _fault(kind: str) -> None:
    print(f"power-soak-fault: {kind}", file=sys.stderr, flush=True)


class InjectedFault(RuntimeFault):
    """A fault the soak injected (a :class:`RuntimeFault`: the server answers a typed 500)."""


@hookimpl
def power_request_start(request: Any) -> None:
    if _roll(CONFIG["observer_raise"] / 2):
        _fault("observer_start_raise")
        raise KeyError("soak observer bug at start")


@hookimpl
def power_request_end(receipt: Any) -> None:
    if _roll(CONFIG["observer_sleep"]):
        _fault("observer_sleep")
        time.sleep(CONFIG["observer_sleep_s"])
    if _roll(CONFIG["observer_raise"]):
        _fault("observer_end_raise")
        raise RuntimeError("soak observer bug at end")


def _patch_native() -> None:
    # (an import that fails fails the server's start, naming this plugin: faults never silently off)
    from power_native.batch import LlamaBatch
    from power_native.target import LlamaTarget

    decode_batch, restore = LlamaBatch.decode_batch, LlamaTarget.restore

    def faulty_decode_batch(self: Any, items: Any) -> Any:
        if _roll(CONFIG["pass_fault"]):
            _fault("pass")
            raise InjectedFault("soak: the shared target pass failed (injected)")
        return decode_batch(self, items)

    def faulty_restore(self: Any, checkpoint: Any) -> None:
        global _restores
        if not _ARMED.exists():
            restore(self, checkpoint)
            return
        with _lock:
            _restores += 1
            fire = _restores == CONFIG["restore_fault_at"]
        if fire:
            _fault("target_restore")
            raise InjectedFault("soak: the target's restore failed (injected)")
        restore(self, checkpoint)

    LlamaBatch.decode_batch = faulty_decode_batch  # type: ignore[method-assign]
    LlamaTarget.restore = faulty_restore  # type: ignore[method-assign]


def _patch_suffix() -> None:
    from power_suffix.proposer import SuffixProposer

    restore = SuffixProposer.restore

    def faulty_restore(self: Any, checkpoint: Any) -> None:
        if _roll(CONFIG["proposer_restore_fault"]):
            _fault("proposer_restore")
            raise OSError("soak: the proposer's restore failed (injected)")
        restore(self, checkpoint)

    SuffixProposer.restore = faulty_restore  # type: ignore[method-assign]


_patch_native()
_patch_suffix()
