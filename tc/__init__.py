"""TrueCluster: one LLM across the machines you already own."""

__version__ = "0.1.0"


def version_line() -> str:
    """What tc --version prints."""
    return f"tc {__version__}"
