"""torchrun for the learner's container, exiting with the learner's own reason.

    python -m services.run.learner_torchrun <torchrun arguments> \
        -m services.cli learner --config FILE

torchrun exits 1 whatever code its ranks exited with (torch 2.13: a rank that exits 4 makes
torchrun exit 1), and 1 again when it is stopped by SIGTERM. A Kubernetes Job reading that code
cannot tell a crash, worth a retry from the newest checkpoint, from a learner that must not be
restarted. This runs torchrun in this process, with the same arguments, and exits with:

    0        every rank finished
    4        a rank exited with EXIT_CHECKPOINT_REFUSED: the newest checkpoint failed
             verification; restarting meets the same files, an operator must act
    3        a rank exited with EXIT_NOT_THE_LEARNER: another learner holds this run's lease
    2        a rank exited with EXIT_BAD_CONFIG: the configuration was refused, or the model
             could not be fetched (the Job retries it: a fetch may fail for a moment)
    1        any other failure of a rank (a crash: the next attempt resumes from the newest
             committed checkpoint)
    128 + N  torchrun was stopped by signal N (143 for SIGTERM) and passed it to its ranks
             (SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT): the learner checkpointed and
             exited 0, but the run is not finished, so the Job must not count the pod complete

The Job's podFailurePolicy (deploy/k8s/base/learner.yaml) fails the Job at once on 3 and 4. It
reads the codes only: the learner's `learner-refused-checkpoint.txt` is not consulted here, so a
file left by an earlier refusal cannot fail a later healthy start.

Only local ranks are seen: on a multi-node learner each pod reports its own ranks.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence

from contracts.runtime import (
    EXIT_BAD_CONFIG,
    EXIT_CHECKPOINT_REFUSED,
    EXIT_NOT_THE_LEARNER,
)

log = logging.getLogger("dapo.learner_torchrun")

EXIT_CRASHED = 1
"""What torchrun itself exits with on any failure; kept for failures that are not a verdict."""
VERDICTS = (EXIT_CHECKPOINT_REFUSED, EXIT_NOT_THE_LEARNER, EXIT_BAD_CONFIG)
"""Rank exit codes passed through, in precedence: a refused checkpoint needs an operator
whatever else the other ranks did."""
EXPLANATIONS = {
    EXIT_CHECKPOINT_REFUSED: "the learner refused the newest checkpoint: it failed verification. "
    "The reason (step and files) is in the log above and in learner-refused-checkpoint.txt in "
    "the run's output_dir. Move that step out of the checkpoint directory (or restore it from "
    "a copy you trust), then start the learner again",
    EXIT_NOT_THE_LEARNER: "another learner holds this run's lease (the holder is named in the log "
    "above): stop it, or wait for it to finish, before starting this one",
    EXIT_BAD_CONFIG: "the learner refused its configuration, or could not fetch its model (the "
    "log above says which): fix the configuration, or check the network and the model's id",
}


def container_exit_code(rank_exit_codes: Iterable[int]) -> int:
    """The container's exit code for ranks that failed with these codes (negative: a signal)."""
    codes = set(rank_exit_codes)
    return next((code for code in VERDICTS if code in codes), EXIT_CRASHED)


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(argv)))  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        log.error("%s", exc)  # torchrun's table of failed ranks and their exit codes
        code = container_exit_code(failure.exitcode for failure in exc.failures.values())
        if code in EXPLANATIONS:
            log.error("exiting %d: %s", code, EXPLANATIONS[code])
        else:
            log.error(
                "exiting %d: a learner rank failed; the next attempt resumes from the newest "
                "committed checkpoint",
                code,
            )
        return code
    except SignalException as exc:
        log.warning(
            "stopped by %s after the ranks stopped; exiting %d so the Job does not count the run "
            "as done",
            exc.sigval.name,
            128 + exc.sigval,
        )
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    from services.logs import setup_logging

    setup_logging("learner-torchrun")
    sys.exit(main(sys.argv[1:]))
