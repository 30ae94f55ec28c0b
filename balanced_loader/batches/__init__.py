"""Stage 2: global batches of sequences (epoch order, sequences, the batch cursor, mixtures, schedules)."""
