"""Small shared helpers: seeding, logging setup and config utilities."""
