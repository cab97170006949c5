"""Demo-only code, apart from the product: the synthetic arithmetic task and the tiny base-model
builder that let `dapo run` train on a CPU in minutes."""
