"""Fault tolerance: the supervisor that watches a training process, and the trainer's side of the contract
(heartbeat, control file, fault injection for tests)."""
