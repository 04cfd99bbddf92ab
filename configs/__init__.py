"""ml-collections configs: one file per preset / training phase (data only)."""
