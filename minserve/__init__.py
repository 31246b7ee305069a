"""minserve."""
