"""Meshes, sharding rules and multi-process start-up."""
