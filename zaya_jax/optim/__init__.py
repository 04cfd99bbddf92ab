"""Optimizers: Muon (Newton-Schulz on every weight matrix, stacked layers and experts included), the Muon/AdamW
partition by parameter path, learning-rate schedules, and the router balancing-bias controller."""
