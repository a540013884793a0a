"""TransMLA."""
