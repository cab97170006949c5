"""The shared contracts (`contracts/`), the gatekeeper stage (`gatekeeper.py`), the application
shell (`shell/`: CLI, launcher, API, Ray Serve, embedded Redis) and the CPU demo (`demo/`)."""
