"""Keel: a monitoring and stability toolkit with an embedded 3D-parallel trainer."""

__version__ = "0.1.0"
