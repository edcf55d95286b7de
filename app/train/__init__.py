"""Training: the Trainer and what it is handed (one update, checkpoint contents and exact resume, stop rules,
validation, guided alignment, weight averages, bf16 master weights)."""
