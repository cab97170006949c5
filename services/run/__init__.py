"""`dapo run` on one machine: the launcher and the supervisor of the service processes, the run's
progress line and outputs, the embedded Redis, torchrun for the learner's container, and the
whole algorithm in one process (`dapo run --in-process`)."""
