"""Attention-based neural machine translation: prepare, train, evaluate and visualise."""
