"""The package version, read by pyproject.toml and written into every merged file."""

__version__ = "0.1.0"
