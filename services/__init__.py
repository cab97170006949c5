"""Glue every process shares: config, Redis stream protocol and schemas, the gatekeeper, the
control-plane API and the command line."""
