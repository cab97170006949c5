"""Pure DAPO algorithm functions: tensors in, tensors out.

No config objects, no I/O, no ``torch.distributed``: the trainer owns those and passes plain
numbers (clip bounds, global token counts) in. Modules:

- ``advantages``: group-relative advantages (docs/algorithm.md section 3).
- ``aggregation``: ``loss_agg`` modes and the global-count rule for gradient accumulation and
  data parallelism (section 5).
- ``losses``: clipped policy loss with dual clip and truncated importance weights (sections 4
  and 9) and ``combine_losses`` (DAPO has no KL term).
- ``entropy``: chunked, memory-light entropy and log-probs from logits, or straight from the
  final hidden states (the logits never built).
"""

from learner.algos.advantages import group_advantages
from learner.algos.aggregation import (
    LOSS_AGG_MODES,
    LossAgg,
    aggregate_loss,
    count_seqs,
    count_tokens,
)
from learner.algos.entropy import entropy_from_logits, log_probs_from_hidden, log_probs_from_logits
from learner.algos.losses import BEHAVIOUR_METRICS, DEFAULT_IS_CLIP, combine_losses, policy_loss

__all__ = [
    "BEHAVIOUR_METRICS",
    "DEFAULT_IS_CLIP",
    "LOSS_AGG_MODES",
    "LossAgg",
    "aggregate_loss",
    "combine_losses",
    "count_seqs",
    "count_tokens",
    "entropy_from_logits",
    "group_advantages",
    "log_probs_from_hidden",
    "log_probs_from_logits",
    "policy_loss",
]
