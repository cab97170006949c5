"""Weight sync: how the learner's newest weights reach the rollout replicas.

- `transport`: the side process group, bucket planning, and `WeightStream` (what an engine's
  `update_weights` receives).
- `publisher.WeightPublisher`: learner rank 0's half (stage, two-phase join, broadcast,
  quarantine, catch-up of lagging replicas).
- `subscriber.WeightSubscriber`: a replica's half (join, receive, fall back to or catch up from
  the checkpoint store, the policy version held).

Raw Redis access for the weights stream, the join set and the decision key lives here only.
"""

from services.contracts.weight_sync.publisher import WeightPublisher
from services.contracts.weight_sync.subscriber import WeightSink, WeightSubscriber
from services.contracts.weight_sync.transport import (
    DTYPES,
    Announcement,
    ParamSpec,
    WeightStream,
    broadcast_bucket,
    bucket_numel,
    dtype_of,
    flat_broadcast_seconds,
    make_group,
    make_group_on_store,
    plan_buckets,
    unflatten,
)

__all__ = [
    "DTYPES", "Announcement", "ParamSpec", "WeightPublisher", "WeightSink", "WeightStream", "WeightSubscriber",
    "broadcast_bucket", "bucket_numel", "dtype_of", "flat_broadcast_seconds", "make_group", "make_group_on_store", "plan_buckets", "unflatten",
]
