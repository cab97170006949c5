"""The application on top of the stages: the `dapo` CLI (`cli.py`, its handlers in
`commands.py`) and Ray Serve hosting (`ray_serve.py`), and one folder per product: `run/` (`dapo
run` on one machine), `data/` (what a run needs prepared), `api/` (the control plane and
dashboard), `planning/` (`dapo plan`), `experiments/` (`dapo eval`, `dapo ablate`) and the CPU
demo (`demo/`). It may import the stages and the contracts; nothing below imports it."""
