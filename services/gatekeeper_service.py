"""`dapo gatekeeper`: the dynamic-sampling stage as a process (see services/gatekeeper.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

from services.config import DapoConfig
from services.gatekeeper import Gatekeeper
from services.keys import Keys
from services.streams import StreamBus, connect
from services.worker import Heartbeat, StopFlag, instance_id, run_stage_loop

log = logging.getLogger(__name__)


def main(cfg: DapoConfig) -> int:
    url = cfg.redis_url
    if not url:
        raise SystemExit("dapo gatekeeper: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)")
    stop = StopFlag().install()
    inst = instance_id("gatekeeper")
    client = connect(url)
    bus = StreamBus(client, Keys(cfg.queue.namespace), consumer=inst)
    bus.ensure_groups()
    gate = Gatekeeper(bus, metric=cfg.algorithm.gatekeeper_metric, enabled=cfg.algorithm.gatekeeper)

    def status() -> dict[str, Any]:
        return {"kept": gate.kept, "filtered": gate.filtered, "pass_rate": round(gate.pass_rate, 4)}

    hb = Heartbeat(client, bus.keys, "gatekeeper", inst, cfg.queue.heartbeat_ttl_s, status).start()
    try:
        run_stage_loop(bus, bus.keys.scored, gate.handle, queue=cfg.queue, stop=stop, batch=32)
    finally:
        client.hset(bus.keys.final_stats("gatekeeper", inst), mapping={k: json.dumps(v) for k, v in status().items()})
        hb.stop()
    log.info("gatekeeper stopped: kept %d, filtered %d", gate.kept, gate.filtered)
    return 0
