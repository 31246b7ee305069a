"""Your workspace: one module per chapter; check it with `minserve check NN`."""
