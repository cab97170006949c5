"""The application shell: the `dapo` CLI, the one-machine launcher and supervisor, the REST
control plane and dashboard, Ray Serve hosting and the embedded Redis. The only code that
imports several stages."""
