"""The package's version, in a room of its own so that any room may read it (the launcher
prints it) without importing the package's front."""

__version__ = "0.1.0"
