"""Model sources: the embedded real model (SmolLM2-135M-Instruct) and tiny random models for tests."""
