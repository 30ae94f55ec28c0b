"""Planning policies, one module each; see :data:`balanced_loader.planning.POLICIES`."""
