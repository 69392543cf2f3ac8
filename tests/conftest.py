"""Shared test setup. This file also puts ``tests/`` on the import path, so tests can import
the helpers kept here (``from tiny_lab import tiny_lab_toml``)."""
