"""Measuring what a run is worth: `dapo eval` (avg@k of a model or of a finished run's
checkpoints), `dapo ablate` (the paper's ablation ladder), the run's curves as SVG, and the
provenance stamped on every result."""
