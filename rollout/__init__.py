"""Generation: engines (vLLM, transformers), the rollout worker loop and the weight receiver."""
