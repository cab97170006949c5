"""The application on top of the stages: the `dapo` CLI, the one-machine launcher and supervisor,
the REST control plane and dashboard, Ray Serve hosting, the embedded Redis, planning, and the CPU
demo (`demo/`). It may import the stages and the contracts; nothing below imports it."""
