"""The control plane: `dapo api` (REST routes and the dashboard it serves) and the run's status
read out of Redis, which `/status`, `/metrics` and `dapo status` share."""
