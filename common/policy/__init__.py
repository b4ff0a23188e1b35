"""Scheduling policies as pure functions over plain snapshots (the services and the simulator call the same ones)."""
