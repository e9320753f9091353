"""Reward shaping over a tree, path-level group advantages and routing of samples to the agents that made them."""
