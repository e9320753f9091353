"""The shared search tree: nodes, Thompson-sampled agent-node expansion, prompts and the batched rollout driver."""
