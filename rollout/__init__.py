"""Generation: engines behind one interface (vLLM, transformers) and the rollout replica loop;
weights arrive through `services.contracts.weight_sync`."""
