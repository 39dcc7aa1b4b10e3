"""Shared fixtures, the ``--zoo`` option (tests marked ``zoo``, the whole transformers sweep, ~20
minutes on 2 cores, run only when it is given), Triton's interpreter on a machine without a GPU, and
on a GPU the memory etiquette of parallel test processes."""

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


# On a GPU, pytest-xdist runs one process per core (16 on the GPU box), each with its own CUDA caching
# allocator. Memory one test frees stays reserved in its worker unless released, and the tests marked
# ``cuda`` (test_gpu_kernels: Llama-3-sized heads, 4 GiB of NaN poison each) each reserve several GiB:
# on an 80 GiB H100 sixteen of them at once ran the GPU out of memory (this session: 131 tests failed
# with CUDA OOM, none on the 141 GiB H200 before). So every test gives its cached blocks back when it
# ends, and at most CUDA_SLOTS tests marked ``cuda`` run at once (a file-lock semaphore across workers).
CUDA_SLOTS = 4
_SLOT_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"inductor_xent_cuda_slots_{os.getuid()}")


@pytest.fixture(autouse=True)
def _cuda_memory_etiquette(request):
    if not torch.cuda.is_available():
        yield
        return
    slot = _take_cuda_slot() if request.node.get_closest_marker("cuda") else None
    try:
        yield
    finally:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if slot is not None:
            slot.close()  # closing the file releases its lock


def _take_cuda_slot():
    import fcntl
    import time

    os.makedirs(_SLOT_DIR, exist_ok=True)
    while True:
        for i in range(CUDA_SLOTS):
            f = open(os.path.join(_SLOT_DIR, f"slot{i}"), "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return f
            except OSError:
                f.close()
        time.sleep(0.05)


def pytest_addoption(parser):
    parser.addoption("--zoo", action="store_true", help="run the whole transformers zoo sweep (tests marked zoo)")


def pytest_collection_modifyitems(config, items):
    # The longest tests first, so that pytest-xdist's workers start them at once instead of one worker
    # finishing the suite alone with them: on the GPU box (16 workers) the README's snippets took 222 s,
    # and the run's tail was the few tests marked ``slow`` that happened to be collected last.
    # ``slow(s=...)`` is the longest duration seen (seconds, either machine); a stable sort keeps the
    # collection order otherwise.
    items.sort(key=_slowness)
    if config.getoption("--zoo"):
        return
    skip = pytest.mark.skip(reason="the whole zoo sweep: run with --zoo -m zoo")
    for item in items:
        if item.get_closest_marker("zoo"):
            item.add_marker(skip)


def _slowness(item) -> float:
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else -float(mark.kwargs.get("s", 1))


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
    backend is looked up (transformers' ``warning_once`` not ignored, no nested graph breaks, no
    dynamic output shapes captured), and
    their environment variables unset; the test's changes to them are undone afterwards."""
    from inductor_xent import dynamo_tuning

    monkeypatch.delenv("INDUCTOR_XENT_DYNAMO_TUNING", raising=False)
    monkeypatch.delenv("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", raising=False)
    monkeypatch.delenv("INDUCTOR_XENT_CAPTURE_DYNAMIC_OUTPUT_SHAPES", raising=False)
    cfg = torch._dynamo.config
    untuned = {f for f in cfg.ignore_logging_functions if not f == dynamo_tuning.transformers_warning_once()}
    with cfg.patch(ignore_logging_functions=untuned, nested_graph_breaks=False, capture_dynamic_output_shape_ops=False):
        yield cfg


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """For the kernels' bit-for-bit tests of a row alone and inside a batch, under the interpreter:
    ``tl.dot`` summed in fp64 and rounded once to its fp32 accumulator, so a row's products come out
    the same bits wherever the row sits in its block, as on a GPU's tensor cores. The interpreter's
    own dot is numpy's fp32 matmul, whose OpenBLAS kernels (Haswell's, which this project's CI
    environment sets with OPENBLAS_CORETYPE, and Zen's) round a row apart by its position in the
    block: those tests failed on an AMD EPYC machine for that alone. Nothing changes on a GPU."""
    if torch.cuda.is_available():
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():  # (fp8: the interpreter's own dot)
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(acc)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    original = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)

