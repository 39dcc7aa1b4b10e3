"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def small_chunks(monkeypatch):
    """Force the chunked path to use many chunks on tiny inputs."""
    from inductor_xent import config

    monkeypatch.setattr(config, "fallback_chunk_bytes", 256)
    return config


@pytest.fixture
def fresh_dynamo():
    """Each compile test starts and ends with a fresh Dynamo, empty counters and no install()."""
    from torch._dynamo.utils import counters

    import inductor_xent

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    inductor_xent.uninstall()
