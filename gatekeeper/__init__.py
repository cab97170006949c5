"""The gatekeeper stage: dynamic sampling and eval reduction between reward and learner."""
