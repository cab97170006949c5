"""Contracts every process shares: the config tree, Redis keys, message schemas, the stream bus
(the only code that talks to Redis), the checkpoint-store layout, the weight-sync wire format and
its Redis channel, the lease and the service runtime. Imports no stage and no application code
(enforced by import-linter)."""
