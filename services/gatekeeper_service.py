"""`dapo gatekeeper`: the dynamic-sampling stage as a process (see services/gatekeeper.py)."""

from __future__ import annotations

import logging
from typing import Any

from services.config import DapoConfig
from services.gatekeeper import Gatekeeper
from services.worker import run_stage_loop, service_context

log = logging.getLogger(__name__)


def main(cfg: DapoConfig) -> int:
    ctx = service_context(cfg, "gatekeeper")
    gate = Gatekeeper(ctx.bus, metric=cfg.algorithm.gatekeeper_metric, enabled=cfg.algorithm.gatekeeper)

    def status() -> dict[str, Any]:
        return {"kept": gate.kept, "filtered": gate.filtered, "pass_rate": round(gate.pass_rate, 4)}

    hb = ctx.heartbeat(cfg.queue.heartbeat_ttl_s, status)
    try:
        run_stage_loop(ctx.bus, ctx.bus.keys.scored, gate.handle, queue=cfg.queue, stop=ctx.stop, batch=32)
    finally:
        ctx.write_final_stats(status())
        hb.stop()
    log.info("gatekeeper stopped: kept %d, filtered %d", gate.kept, gate.filtered)
    return 0
