"""The command line: `python -m inductor_xent demo | bench`, its errors, and the scan plot."""

import json

import pytest
import torch

from inductor_xent import __main__ as cli
from inductor_xent import bench, ops


def test_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out
    assert cli.main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err
    assert cli.main(["bench", "speed"]) == 2
    assert "unknown benchmark 'speed'; choose one of kernels, e2e, rl" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_bench_without_gpu_says_what_to_run_instead(capsys):
    assert cli.main(["bench", "kernels", "--methods", "ours"]) == 2
    err = capsys.readouterr().err
    assert "torch sees no CUDA device" in err and "benchmarks/cpu_fallback.py" in err
    assert cli.main(["bench", "e2e"]) == 2
    assert "bench e2e needs a CUDA GPU" in capsys.readouterr().err


def test_bench_rejects_unknown_methods(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "kernels", "--methods", "ours,fastest"])
    assert exc.value.code == 2
    assert "unknown method(s) fastest; choose from cublas, eager" in capsys.readouterr().err


def test_scan_plot_from_rows(tmp_path):
    """The --scan plot: lines against V and against N from the rows the benchmark writes."""
    pytest.importorskip("matplotlib")
    module = bench._load("kernels")
    rows = []
    for name, shape in module.scan_shapes().items():
        for method, ms, mib in (("eager", 50.0, 10000.0), ("ours", 60.0, 192.0)):
            scale = shape.n * shape.v / (8192 * 128256)
            rows.append({"shape": name, "method": method, "n": shape.n, "d": shape.d, "v": shape.v,
                         "fwdbwd_ms": ms * scale, "extra_mib": mib * (scale if method == "eager" else 1)})
    info = {"gpu": "test", "torch": torch.__version__, "triton": "-", "date": "today"}
    module.plot_scan(rows, info, tmp_path / "scan.png")
    assert (tmp_path / "scan.png").stat().st_size > 10_000
    assert {r["v"] for r in rows} == set(module.SCAN_V) and {r["n"] for r in rows} == set(module.SCAN_N)
    json.dumps(rows)


@pytest.mark.slow(s=21)
def test_demo_runs_and_fuses(capsys):
    """The main job, shortened: both backends train, the site is fused, the losses agree."""
    from inductor_xent import demo

    assert demo.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 fused, 0 declined" in out
    from inductor_xent import strategy

    shape = demo.GPU_SHAPE if torch.cuda.is_available() else demo.CPU_SHAPE
    plan = strategy.choose(None, shape["hidden"], shape["vocab"], shape["dtype"], shape["dtype"], reduction="mean",
                           needs=(True, True, False), device="cuda" if torch.cuda.is_available() else "cpu")
    # the graph after the pass: auto's choice (CPU: store fits; the GPU demo's D = 1024: recompute)
    assert f"torch.ops.{ops.STORE if plan.strategy == 'store' else ops.FORWARD}" in out
    assert "memory saved per step" in out
    torch._dynamo.reset()


