"""Generation: engines behind one interface (vLLM, transformers) and the rollout replica loop;
weights arrive through `contracts.weight_sync`."""
