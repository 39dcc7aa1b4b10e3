"""Observability through torch's own logging (inductor_xent/logs.py): ``TORCH_LOGS=inductor_xent``
(sites), ``+inductor_xent`` (graphs before and after), ``TORCH_TRACE`` artifacts for tlparse, the
pass under ``GraphTransformObserver`` (``disabled_passes`` turns it off), and the deprecated
``INDUCTOR_XENT_DUMP_GRAPHS``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import inductor_xent
from inductor_xent import logs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    h = torch.randn(4, 8, requires_grad=True); W = torch.randn(10, 8, requires_grad=True)
    y = torch.randint(0, 10, (4,))
    f = torch.compile(lambda h, W, y: F.cross_entropy(F.linear(h, W), y), backend="inductor_xent",
                      options={"xent.inner": "aot_eager"})
    f(h, W, y).backward()
""")


def _run(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stderr


def _loss(h, W, y):
    return F.cross_entropy(F.linear(h, W), y)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(10, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


@pytest.mark.slow(s=24)
def test_torch_logs_reports_sites_and_plus_adds_graphs():
    info = _run({"TORCH_LOGS": "inductor_xent"})
    assert "inductor_xent: fused lm_head_cross_entropy site" in info, info[-2000:]
    assert "graph before the pass" not in info
    debug = _run({"TORCH_LOGS": "+inductor_xent"})
    assert "inductor_xent: graph before the pass" in debug and "inductor_xent: graph after the pass" in debug
    after = debug[debug.index("graph after the pass"):]
    assert "torch.ops.inductor_xent.linear_ce_fwd.default" in after, after[:3000]


def test_torch_trace_records_the_graphs_for_tlparse(tmp_path):
    _run({"TORCH_TRACE": str(tmp_path)})
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    for name in logs.ARTIFACTS.values():
        assert f'"name": "{name}"' in text, name
    assert "linear_ce_fwd" in text


def test_registered_in_torchs_log_registry():
    from torch._logging import _internal

    assert _internal.log_registry.is_log("inductor_xent")


def test_disabled_passes_switches_the_pass_off():
    """The pass runs under GraphTransformObserver: Inductor's ``disabled_passes`` names it. (Set with
    the config's own ``patch``: pytest 9.2's monkeypatch restores a module attribute missing from its
    ``__dict__`` by deleting it, which hides a torch config key for every later test.)"""
    assert inductor_xent.explain(_loss, *_inputs()).fused_count == 1
    with torch._inductor.config.patch(disabled_passes="inductor_xent"):
        assert inductor_xent.explain(_loss, *_inputs()).fused_count == 0
    assert torch._inductor.config.disabled_passes == ""


def test_old_dump_switch_still_logs_with_a_deprecation_warning(monkeypatch, caplog):
    monkeypatch.setenv("INDUCTOR_XENT_DUMP_GRAPHS", "1")
    with caplog.at_level(logging.INFO, logger="inductor_xent"), pytest.warns(DeprecationWarning, match="TORCH_LOGS"):
        inductor_xent.explain(_loss, *_inputs())
    text = caplog.text
    assert "graph before the pass" in text and "graph after the pass" in text and "linear_ce_fwd" in text
