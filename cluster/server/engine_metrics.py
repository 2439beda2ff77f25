"""The engines' series on the gateway's /metrics, from a snapshot. Collecting them calls every replica (a Ray call
each, answered between two engine steps), so a scrape never does: the gateway's loop refreshes the snapshot every
REFRESH_S on a worker thread, and a scrape (on the metrics thread, or /metrics on the HTTP port) only reads it. A
replica that is slow to answer delays the next snapshot, never a scrape; ``pagedserve_engine_metrics_age_seconds``
says how old the one served is."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client.core import GaugeMetricFamily, Metric

from pagedserve.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

REFRESH_S = 0.5  # with a quick answer, the series served are at most ~0.5 s old


class EngineCollector:
    """The engine client's metric families, each sample labelled with the served model's name. ``enabled``
    False: none (where several gateways share the replicas, one exports their series, so none is counted twice)."""

    def __init__(self, model_name: str, enabled: bool = True) -> None:
        self.model_name = model_name
        self.enabled = enabled
        self.engine: EngineClient | None = None  # once the replicas are up
        # Replaced whole (never mutated) by refresh(), read by collect() on other threads.
        self._snapshot: tuple[float, list[Metric]] | None = None
        self._task: asyncio.Task | None = None

    def refresh(self) -> None:
        """Take a new snapshot. Blocking (it calls every replica): on a worker thread."""
        if self.engine is None or not self.enabled:
            return
        families = []
        for fam in self.engine.collect_metrics():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                out.add_sample(smp.name, {"model_name": self.model_name, **smp.labels}, smp.value, smp.timestamp)
            families.append(out)
        self._snapshot = (time.monotonic(), families)

    async def start(self, engine: EngineClient) -> None:
        """The first snapshot (so the first scrape has the engines' series), then one every REFRESH_S."""
        self.engine = engine
        if not self.enabled:
            return
        await self._refresh_logged()
        self._task = asyncio.ensure_future(self._refresh_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _refresh_logged(self) -> None:
        try:
            await asyncio.to_thread(self.refresh)
        except Exception as e:  # the last snapshot stays; its age shows on the scrape
            logger.warning("engine metrics not refreshed: %s", e)

    async def _refresh_forever(self) -> None:
        while True:
            started = time.monotonic()
            await self._refresh_logged()
            await asyncio.sleep(max(0.0, REFRESH_S - (time.monotonic() - started)))

    def collect(self):
        snapshot = self._snapshot
        if snapshot is None or not self.enabled:
            return
        taken, families = snapshot
        yield from families
        age = GaugeMetricFamily("pagedserve_engine_metrics_age_seconds", "Age of the engines' series on this scrape "
                                "(taken every 0.5 s; older while a model replica is slow to answer).",
                                labels=["model_name"])
        age.add_metric([self.model_name], time.monotonic() - taken)
        yield age
