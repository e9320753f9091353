"""Sandboxes as the trainer sees them: the local worker pool and E2B's remote sandboxes."""
