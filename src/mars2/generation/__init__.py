"""Generators behind one interface: transformers (CPU/GPU), vLLM (GPU) and simulated agents for tests."""
