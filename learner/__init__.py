"""Learner: turns scored rollouts into policy updates
(DAPO loss, optimiser step, weight publication)."""
