"""Shared fixtures, the ``--zoo`` option (tests marked ``zoo``, the whole transformers sweep, ~20
minutes on 2 cores, run only when it is given), and Triton's interpreter on a machine without a GPU."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter (tests/test_templates.py). It must be on
# before any kernel is defined: Triton reads it at decoration, and triton.language's own jit
# functions are made when triton is first imported, which torch._inductor does early in a session
# (benchmarks/NOTES.md, v5). Pytest imports this file before any test module. Never with a GPU: the
# CUDA tests of the same session run the real kernels.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    parser.addoption("--zoo", action="store_true", help="run the whole transformers zoo sweep (tests marked zoo)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--zoo"):
        return
    skip = pytest.mark.skip(reason="the whole zoo sweep: run with --zoo -m zoo")
    for item in items:
        if item.get_closest_marker("zoo"):
            item.add_marker(skip)


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


@pytest.fixture
def untuned_dynamo(monkeypatch):
    """Dynamo's two options that ``dynamo_tuning.tune_dynamo`` sets, as a fresh process has them before the
    backend is looked up (transformers' ``warning_once`` not ignored, no nested graph breaks), and
    their environment variables unset; the test's changes to them are undone afterwards."""
    from inductor_xent import dynamo_tuning

    monkeypatch.delenv("INDUCTOR_XENT_DYNAMO_TUNING", raising=False)
    monkeypatch.delenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", raising=False)
    cfg = torch._dynamo.config
    untuned = {f for f in cfg.ignore_logging_functions if not f == dynamo_tuning.transformers_warning_once()}
    with cfg.patch(ignore_logging_functions=untuned, nested_graph_breaks=False):
        yield cfg
