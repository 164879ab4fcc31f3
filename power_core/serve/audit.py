"""The online exactness audit of ``power serve --audit-rate R``.

Power's promise is that speculative output equals target-only output. The audit checks it on live
traffic: a fraction ``R`` of completed speculative requests (every ``1/R``-th, deterministically) is
decoded again target-only — the same prompt, limits and sampling, no proposer — on an idle
sequence, and the two output digests are compared. Audits never hold a user's request back: one
starts only while no request waits for a sequence, and at most :data:`QUEUE_MAX` wait for their turn
(more are skipped and counted).

Results: ``power:audit_checked`` and ``power:audit_mismatch`` (Prometheus counters), the ``audit``
object next to the request's receipt at ``/v1/receipts/{id}``, and on a mismatch an
``audit.mismatch`` error event with both receipts. Under ``require_identical`` a mismatch also
switches the server to target-only until it restarts (``/health`` says why).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

import attrs

from power_core.engine import Engine
from power_core.errors import PowerError, RuntimeFault
from power_core.logs import get_logger
from power_core.receipt import Receipt
from power_core.serve.jobs import Job, Metrics, Outcome, ReceiptStore
from power_core.session import Session
from power_core.transaction import CancelToken

__all__ = ["Auditor", "QUEUE_MAX"]

log = get_logger(__name__)

#: completed requests waiting for their audit; beyond this, audits are skipped (``power:audit_skipped``)
QUEUE_MAX = 64


@attrs.define(eq=False)
class Auditor:
    """Chooses completed requests to audit and re-decodes them target-only (see the module doc)."""

    rate: float
    engine: Engine[Session]
    metrics: Metrics
    receipts: ReceiptStore
    executor: Executor
    #: switch the server to target-only after a mismatch (the sessions' ``require_identical``)
    require_identical: bool = False
    #: why the server now decodes target-only (set by a mismatch under ``require_identical``)
    target_only: str | None = None
    _credit: float = 0.0
    _queue: asyncio.Queue[tuple[Job, Outcome]] | None = None
    #: the audit decoding now (cancelled when the server drains)
    running: CancelToken | None = None

    def start(self) -> asyncio.Task[None] | None:
        """Start auditing on the running event loop (``None`` when the rate is 0)."""
        if self.rate <= 0:
            return None
        self._queue = asyncio.Queue(QUEUE_MAX)
        return asyncio.ensure_future(self._run())

    def consider(self, job: Job, outcome: Outcome) -> None:
        """A request ended (on the event loop): queue it for an audit when it is its turn."""
        r = outcome.receipt
        if self._queue is None or job.target_only or r.status != "completed" or r.strategy["kind"] == "target-only":
            return
        self._credit += self.rate
        if self._credit < 1.0 - 1e-9:
            return
        self._credit -= 1.0
        try:
            self._queue.put_nowait((job, outcome))
        except asyncio.QueueFull:
            self.metrics.audit_skipped.inc()

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            job, outcome = await self._queue.get()
            session = await self._idle_sequence()
            token = self.running = CancelToken()
            try:
                audit = await loop.run_in_executor(self.executor, self._redecode, session, job, token)
            except PowerError as exc:  # an audit that could not run checks nothing; the server serves on
                log.warning("audit.failed", id=job.id, error=f"{exc.code}: {exc}")
                continue
            except Exception:  # noqa: BLE001 - a defect: logged with its traceback, the audits go on
                log.error("audit.crashed", id=job.id, exc_info=True)
                continue
            finally:
                self.running = None
            if audit.status == "completed":
                self._record(job, outcome.receipt, audit)

    async def _idle_sequence(self) -> Session:
        """A sequence nobody waits for (user requests go first)."""
        while True:
            if self.engine.waiting == 0:
                try:
                    ticket = self.engine.reserve()
                except PowerError:  # busy, closed, or every sequence lost: try again later
                    ticket = None
                if ticket is not None:
                    if ticket.ready and ticket.session is not None:
                        return ticket.session
                    ticket.withdraw()
            await asyncio.sleep(0.02)

    def _redecode(self, session: Session, job: Job, token: CancelToken) -> Receipt:
        """``job`` again, target-only, on ``session`` (a worker thread): the re-decode's receipt, which
        says how it ended. A re-decode that never began (the engine or the session refused it, or its
        ``begin`` failed; the engine has given the sequence back) is a :class:`PowerError`: the
        refusal itself, or a :class:`RuntimeFault` wrapping a foreign exception."""
        try:  # the request's compiled constraint has parsed its output: the re-decode's starts fresh
            gen = session.start(job.prompt, cancel=token, max_tokens=job.max_tokens, stop=job.stop,
                                sampling=job.sampling, target_only=True,
                                constraint=job.constraint.spec if job.constraint is not None else None,
                                strategy=job.strategy,
                                tenant=job.tenant)  # (the request's tenant: its prompt state stays theirs)
        except BaseException:
            self.engine.release(session)
            raise
        failure: Exception | None = None
        try:
            self.engine.run(gen)
        except Exception as exc:  # noqa: BLE001 - a re-decode that ran has a receipt that says how it ended
            failure = exc
        if gen.receipt is not None:
            return gen.receipt
        if isinstance(failure, PowerError):
            raise failure
        raise RuntimeFault(f"the audit's re-decode of request {job.id} never began: "
                           f"{type(failure).__name__}: {failure}") from failure

    def _record(self, job: Job, receipt: Receipt, audit: Receipt) -> None:
        identical = audit.output_sha256 == receipt.output_sha256
        self.metrics.audit_checked.inc()
        result: dict[str, Any] = {"identical": identical, "output_sha256": audit.output_sha256,
                                  "output_tokens": audit.output_tokens, "receipt_sha256": audit.digest()}
        self.receipts.annotate(job.id, "audit", result)
        if identical:
            log.info("audit.checked", id=job.id, identical=True)
            return
        self.metrics.audit_mismatch.inc()
        log.error("audit.mismatch", id=job.id, receipt=receipt.to_dict(), audit_receipt=audit.to_dict())
        if self.require_identical and self.target_only is None:
            self.target_only = (f"the audit of request {job.id} found its output different from its target-only "
                                "re-decode (require_identical)")
            log.error("audit.target_only", reason=self.target_only)
