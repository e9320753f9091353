"""Small helpers shared across the other packages; empty until two of them need the same one."""
