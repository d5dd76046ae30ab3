"""TrueCluster: one LLM across the machines you already own."""

__version__ = "0.1.0"
