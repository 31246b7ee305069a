"""The scheduling plane: which sequences run in each step, and how many tokens each."""
