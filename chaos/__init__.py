"""Fault injectors (plain hooks the trainer calls) and the drill runner."""
