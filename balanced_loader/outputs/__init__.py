"""Outputs of every command and benchmark: results as records (and, after the move, atomic files and locks)."""
