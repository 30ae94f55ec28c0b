"""Diagnostics of plans and runs: Chrome / Perfetto traces (:mod:`balanced_loader.diagnostics.trace`)."""
