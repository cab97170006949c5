"""`dapo plan`: size a cluster before renting it.

`capacity` says whether a config fits in GPU memory and `placement` which GPUs each process of
`dapo run` gets (`dapo run` reads both too); the rest says how fast it would run: `hardware`
(the GPU table, `gpus.toml`), `costs` (what each stage's work costs on those GPUs, from the
model's shape), `simulation` (a discrete-event simulation of the pipeline with simpy: admission
control, replicas, reward and gatekeeper, learner steps, weight syncs, staleness), `calibration`
(the simulation checked against a measured run and against published
asynchronous-vs-synchronous speed-ups) and `plan` (what `dapo plan` prints).
docs/planning.md gives the model, its assumptions and its measured errors.
"""
