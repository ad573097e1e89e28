"""Fleet sync from a central bucket (see DESIGN.md): sources, verification, atomic commit."""
