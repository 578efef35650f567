"""The sv-attention version, in one place (read by the package and by the remote-code config)."""

__version__ = "0.1.0"
