"""Shared fixtures."""

import pytest


@pytest.fixture
def small_chunks(monkeypatch):
    """Force the chunked path to use many chunks on tiny inputs."""
    from inductor_xent import config

    monkeypatch.setattr(config, "fallback_chunk_bytes", 256)
    return config
