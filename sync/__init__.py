"""Fleet sync from a central bucket (see docs/architecture.md): sources, verification, atomic commit."""
