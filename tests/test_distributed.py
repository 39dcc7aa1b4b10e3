"""Distributed training through torch.distributed's own engine, on CPU with gloo: FSDP2
(``fully_shard``), vocabulary-parallel tensor parallelism (DTensor ``ColwiseParallel`` with
``loss_parallel``, as torchtitan spells it), and both on a 2-D mesh.

Every test spawns ``world_size`` processes (2 or 4) that meet through a file store. The parent joins
them with a deadline and the process group has a timeout, so a hang fails the test instead of
stalling CI. Each rank checks its own numbers against a single-process reference built from the
same seed (loss and every parameter's gradient, gathered with ``full_tensor``) and the pass's
counters or ``explain``; an assertion in any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

import inductor_xent  # noqa: E402  (backend="inductor_xent" in every rank, also from a source tree)
from inductor_xent import ops  # noqa: E402

# V divisible by 2 and 4 (the vocabulary shards), SEQ by 4 (the sequence-parallel shards); UNEVEN is
# a prime vocabulary that no shard count divides
V, UNEVEN, D, BATCH, SEQ = 96, 97, 16, 2, 8
JOIN_TIMEOUT_S = 300  # the whole spawned run: fails instead of stalling CI
COLLECTIVE_TIMEOUT_S = 90  # one collective: a rank that never arrives raises in the others
AOT = {"xent.inner": "aot_eager"}  # AOTAutograd + Inductor's partitioner, no code generation


# ---------------------------------------------------------------------------------------------
# the model: HF-shaped (the layers loop in a nested module, the loss in the root's forward)
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Body(nn.Module):
    """Embedding, blocks and final norm in their own module, as HF keeps them (``model.model``):
    FSDP2's per-block hooks are graph breaks inside this loop, and Dynamo runs a frame whose loop
    breaks eagerly, so the loop must not share a frame with the loss."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


class TinyLM(nn.Module):
    """HF's ``ForCausalLMLoss`` spelling: ``lm_head(h).float().view(-1, V)`` -> cross_entropy; the
    forward returns the loss only (so the logits die inside the compiled region)."""

    def __init__(self, vocab: int = V, bias: bool = False, label_smoothing: float = 0.0):
        super().__init__()
        self.body = Body(vocab)
        self.lm_head = nn.Linear(D, vocab, bias=bias)
        self.label_smoothing = label_smoothing

    def forward(self, ids, labels):
        z = self.lm_head(self.body(ids)).float()
        return F.cross_entropy(z.view(-1, z.shape[-1]), labels.view(-1), ignore_index=-100,
                               label_smoothing=self.label_smoothing)


def build(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def batch(index: int, vocab: int = V):
    """Batch ``index`` (one per data-parallel rank); some ignored labels, one fully ignored row."""
    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, ::3] = -100
    if index % 2:
        labels[1] = -100
    return ids, labels


def reference(batches, **kw):
    """Single process, eager: the mean over ``batches`` of the loss (what data parallelism averages)
    and every parameter's gradient."""
    model = build(**kw)
    loss = sum(model(i, y) for i, y in batches) / len(batches)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_matches(loss, model, ref, *, rtol=1e-4, atol=1e-6):
    ref_loss, ref_grads = ref
    torch.testing.assert_close(full(loss).detach(), ref_loss, rtol=rtol, atol=atol, msg="loss")
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_grads[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def xent_counters() -> dict:
    from torch._dynamo.utils import counters

    return dict(counters["inductor_xent"])


def fresh():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


# ---------------------------------------------------------------------------------------------
# spawning: one process per rank, a deadline on the join, a timeout on every collective
# ---------------------------------------------------------------------------------------------
def _entry(rank, world_size, store, worker, args):
    torch.set_num_threads(1)  # CI shares 2 cores among all ranks
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        worker(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(tmp_path, world_size: int, worker, *args):
    ctx = mp.start_processes(_entry, args=(world_size, str(tmp_path / "store"), worker, args),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{worker.__name__} did not finish within {JOIN_TIMEOUT_S} s (a hang?)")


# ---------------------------------------------------------------------------------------------
# tensor parallelism: the three spellings of a vocabulary-parallel head
# ---------------------------------------------------------------------------------------------
def tp_plan(model: TinyLM, spelling: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if spelling == "loss_parallel":  # torchtitan without sequence parallel: Shard(-1) DTensor logits
        return {"lm_head": ColwiseParallel(use_local_output=False)}
    if spelling == "replicate":  # all-gathered logits, a plain cross_entropy
        return {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    assert spelling == "sequence_parallel"  # torchtitan's full plan
    plan = {
        "body.emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "body.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }
    for i in range(len(model.body.blocks)):
        plan[f"body.blocks.{i}.norm"] = SequenceParallel()
        plan[f"body.blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"body.blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def loss_context(spelling: str):
    """torchtitan enters ``loss_parallel()`` around the step, outside the compiled region (inside it
    Dynamo fails on cross_entropy of a DTensor with any backend)."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    return contextlib.nullcontext() if spelling == "replicate" else loss_parallel()


# which TinyLM options each spelling runs: loss_parallel has no label smoothing
TP_MODEL = {
    "loss_parallel": {},
    "replicate": {"bias": True, "label_smoothing": 0.1},
    "sequence_parallel": {},
}


# the op on DTensors in float64, against the materialising oracle: (label_smoothing, z_loss,
# softcap, logit_scale, bias); smoothing and softcap never together (declined)
OP_GRID = [(0.0, 0.0, None, 1.0, False), (0.1, 1e-2, None, 0.5, True), (0.0, 1e-3, 3.0, 2.0, True)]


def _op_checks(mesh):
    """The ops with a Shard(0) DTensor weight, eagerly: ``linear_ce_fwd`` / ``linear_ce_bwd``
    (what the pass emits: per-row losses, any incoming gradient) and ``linear_ce_store`` (what the
    public function calls for a reduced loss) give the single-process oracle's loss and every
    gradient, to float64 rounding."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import inductor_xent.distributed  # noqa: F401  (the DTensor rules)
    from inductor_xent import reference as oracle

    torch.manual_seed(0)
    for eps, z_loss, softcap, scale, with_bias in OP_GRID:
        x, w = torch.randn(15, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
        b = torch.randn(V, dtype=torch.float64) if with_bias else None
        t = torch.randint(0, V, (15,))
        t[:5] = -100  # ignored rows, and targets in every shard
        t[5:9] = torch.arange(4) * (V // 4)
        row_weights = torch.rand(15, dtype=torch.float64)  # an incoming gradient that is not all ones
        kw = dict(label_smoothing=eps, z_loss=z_loss, softcap=softcap, logit_scale=scale)
        leaves = [x, w] + ([b] if with_bias else [])
        placements = [[Replicate()], [Shard(0)], [Shard(0)]]
        for path in ("recompute", "store"):
            ref = [p.clone().requires_grad_() for p in leaves]
            dts = [distribute_tensor(p, mesh, pl).requires_grad_() for p, pl in zip(leaves, placements)]
            bias_ref, bias_dt = (ref[2], dts[2]) if with_bias else (None, None)
            if path == "recompute":
                expected = (oracle.linear_cross_entropy(ref[0], ref[1], t, bias=bias_ref, reduction="none", **kw)
                            * row_weights).sum()
                rows, *_ = ops.FORWARD(dts[0], dts[1], bias_dt, t, -100, eps, scale, softcap, z_loss)
                loss = (rows.to_local() * row_weights).sum()
            else:
                expected = oracle.linear_cross_entropy(ref[0], ref[1], t, bias=bias_ref, reduction="mean", **kw)
                loss = inductor_xent.linear_cross_entropy(dts[0], dts[1], t, bias=bias_dt, reduction="mean",
                                                          strategy="store", **kw)
            expected.backward()
            loss.backward()
            torch.testing.assert_close(full(loss).detach(), expected.detach(), rtol=1e-12, atol=1e-12, msg=path)
            for got, want in zip(dts, ref):
                torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-12, atol=1e-12, msg=path)

    # every logit 2^24 in float32: log V, which lse - z_t (both rounded to 2^24) would lose
    x, w = torch.full((3, 1), 2.0**12), torch.full((V, 1), 2.0**12)
    loss = inductor_xent.linear_cross_entropy(distribute_tensor(x, mesh, [Replicate()]),
                                              distribute_tensor(w, mesh, [Shard(0)]), torch.tensor([0, 5, V - 1]))
    torch.testing.assert_close(loss.full_tensor(), torch.tensor(math.log(V)), rtol=1e-6, atol=0)

    # a frozen weight: only the hidden states' gradient (the op's needs_weight=False)
    x, w, t = torch.randn(7, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64), torch.randint(0, V, (7,))
    xr = x.clone().requires_grad_()
    oracle.linear_cross_entropy(xr, w, t).backward()
    xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    inductor_xent.linear_cross_entropy(xd, distribute_tensor(w, mesh, [Shard(0)]), t).backward()
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, rtol=1e-12, atol=1e-12)


def aot_graphs(fn, *args):
    """The forward and backward graphs AOTAutograd makes of ``fn`` after our pass (Inductor's
    min-cut partitioner, no code generation), after one forward and backward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from inductor_xent import patterns

    graphs = []

    def record(gm, _):
        graphs.append(gm)
        return gm.forward

    def backend(gm, example_inputs):
        patterns.run(gm)
        return aot_autograd(fw_compiler=record, bw_compiler=record,
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

    torch.compile(fn, backend=backend)(*args).backward()
    return graphs


def _check_graphs(model, ids, labels, world_size):
    """No [N, V/tp] (or [N, V]) tensor in either graph; our two ops; two all-reduces of per-row
    statistics forward, and one backward (the hidden states' gradient)."""
    fw, bw = aot_graphs(lambda i, y: model(i, y), ids, labels)
    rows, shard = BATCH * SEQ, V // world_size
    for g in (fw, bw):
        for n in g.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] in (shard, V):
                assert v.numel() < rows * shard, f"{n.name} {tuple(v.shape)} is a logits-sized tensor"

    def calls(g, name):
        return sum(name in str(n.target) for n in g.graph.nodes if n.op == "call_function")

    assert calls(fw, str(ops.FORWARD)) == 1 and calls(bw, str(ops.BACKWARD)) == 1
    assert calls(fw, "all_reduce") == 2 and calls(bw, "all_reduce") == 1, (calls(fw, "all_reduce"), calls(bw, "all_reduce"))


def _tp_worker(rank, world_size, spellings, options, op_checks=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    if op_checks:
        _op_checks(mesh)
    ids, labels = batch(0)
    for spelling in spellings:
        kw = TP_MODEL[spelling]
        model = build(**kw)
        parallelize_module(model, mesh, tp_plan(model, spelling))
        fresh()
        step = torch.compile(lambda i, y, m=model: m(i, y), backend="inductor_xent", options=options)
        with loss_context(spelling):
            loss = step(ids, labels)
            loss.backward()
        assert xent_counters() == {"sites_fused": 1, "fused.lm_head_cross_entropy": 1}, (spelling, xent_counters())
        assert_matches(loss, model, reference([(ids, labels)], **kw))
        if spelling == "loss_parallel" and op_checks:
            with loss_context(spelling):
                report = inductor_xent.explain(lambda i, y, m=model: m(i, y), ids, labels)
                fresh()
                _check_graphs(model, ids, labels, world_size)
            assert report.fused_count == 1, str(report)
            assert f"vocabulary-parallel over {world_size} ranks" in report.sites[0].reason, str(report)


# spellings per world size: every spelling on 2 ranks; torchtitan's two on 4 (CI has 2 cores)
TP_SPELLINGS = {2: ("loss_parallel", "replicate", "sequence_parallel"), 4: ("loss_parallel", "sequence_parallel")}


@pytest.mark.slow(s=30)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_head_is_vocabulary_parallel(tmp_path, world_size):
    """The op on vocabulary-sharded DTensors matches the oracle; a ColwiseParallel lm_head is fused
    into it, with the loss and gradients one process computes."""
    spawn(tmp_path, world_size, _tp_worker, TP_SPELLINGS[world_size], AOT, True)


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------
def fsdp(model: TinyLM, mesh, *, per_block_backend=None, options=None, mp_policy=None, head_unit=False):
    """``fully_shard`` each block and the root (whose unit holds embedding, final norm and lm_head);
    ``head_unit`` gives the lm_head its own unit. ``per_block_backend`` compiles each block on its
    own first, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for block in model.body.blocks:
        if per_block_backend is not None:
            block.compile(backend=per_block_backend, fullgraph=True, **({"options": options} if options else {}))
        fully_shard(block, **kw)
    if head_unit:
        fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp_worker(rank, world_size, variants):
    """Each variant: (compile_as, precision, real): "whole" compiles the step, "per_block" first
    compiles each block on its own (aot_eager) and then the step (whose graph is then the head and
    the loss); ``real`` compiles the step with real Inductor against backend="inductor", else with
    aot_eager against our pass switched off."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world_size,))
    batches = [batch(r) for r in range(world_size)]
    ref = reference(batches)
    for compile_as, precision, real in variants:
        mp_policy = None if precision == "fp32" else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.float32)
        pairs = {"fused": ("inductor_xent", None if real else AOT),
                 "unfused": ("inductor", None) if real else ("inductor_xent", {**AOT, "xent.enable": False})}
        runs = {}
        for key, (backend, options) in pairs.items():
            model = build()
            fsdp(model, mesh, per_block_backend="inductor_xent" if compile_as == "per_block" else None,
                 options=AOT, mp_policy=mp_policy)
            fresh()
            step = torch.compile(lambda i, y, m=model: m(i, y), backend=backend,
                                 **({"options": options} if options else {}))
            loss = step(*batches[rank])
            loss.backward()
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            runs[key] = (loss, {n: full(p.grad) for n, p in model.named_parameters()}, xent_counters())
        fused, unfused = runs["fused"], runs["unfused"]
        assert fused[2] == {"sites_fused": 1, "fused.lm_head_cross_entropy": 1}, (compile_as, fused[2])
        assert unfused[2].get("sites_fused", 0) == 0
        if precision == "fp32":
            torch.testing.assert_close(fused[0], ref[0], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(unfused[0], ref[0], rtol=1e-4, atol=1e-6)
            for name, grad in fused[1].items():
                torch.testing.assert_close(grad, ref[1][name], rtol=1e-4, atol=1e-6, msg=name)
                torch.testing.assert_close(grad, unfused[1][name], rtol=1e-4, atol=1e-6, msg=name)
        else:  # bf16 parameters: no worse than the unfused run, both against the fp32 reference
            from .helpers import assert_within_torch_error

            assert_within_torch_error(fused[0], unfused[0], ref[0], k=2.0, floor=1e-3, what="loss")
            for name, grad in fused[1].items():
                assert_within_torch_error(grad, unfused[1][name], ref[1][name], k=2.0, floor=1e-2, what=name)


# variants per world size: (compile_as, precision, real Inductor)
FSDP_VARIANTS = {
    2: [("whole", "fp32", False), ("per_block", "fp32", False), ("whole", "bf16", False)],
    4: [("per_block", "bf16", False)],
}


@pytest.mark.slow(s=20)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_head_fused(tmp_path, world_size):
    """fully_shard on the blocks and the root: the head fuses, whole-model and per-block compiled,
    fp32 and bf16 parameters with fp32 gradient reduction; loss and gradients as the unfused run."""
    spawn(tmp_path, world_size, _fsdp_worker, FSDP_VARIANTS[world_size])


def _real_inductor_worker(rank, world_size):
    _tp_worker(rank, world_size, ("loss_parallel",), {})
    _fsdp_worker(rank, world_size, [("per_block", "fp32", True)])


@pytest.mark.slow(s=98)
def test_real_inductor(tmp_path):
    """Real Inductor (C++ codegen): torchtitan's TP spelling, its functional collectives lowered by
    Inductor; and FSDP2's head against backend="inductor" on the same model."""
    spawn(tmp_path, 2, _real_inductor_worker)


# ---------------------------------------------------------------------------------------------
# FSDP2 + TP on a 2-D mesh
# ---------------------------------------------------------------------------------------------
def _fsdp_tp_worker(rank, world_size, spellings, options):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    batches = [batch(r) for r in range(2)]
    for spelling in spellings:
        kw = TP_MODEL[spelling]
        model = build(**kw)
        parallelize_module(model, mesh["tp"], tp_plan(model, spelling))
        fsdp(model, mesh["dp"])
        fresh()
        step = torch.compile(lambda i, y, m=model: m(i, y), backend="inductor_xent", options=options)
        with loss_context(spelling):
            loss = step(*batches[dp_rank])
            loss.backward()
        assert xent_counters() == {"sites_fused": 1, "fused.lm_head_cross_entropy": 1}, (spelling, xent_counters())
        loss = full(loss).detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        assert_matches(loss, model, reference(batches, **kw))


@pytest.mark.slow(s=20)
def test_fsdp2_and_tensor_parallel_2d_mesh(tmp_path):
    """A (dp=2, tp=2) mesh, torchtitan's order (TP first, then FSDP2 over dp): the head fuses into
    the vocabulary-parallel op; loss and gradients as one process over both data shards.

    Not "sequence_parallel": with FSDP2 on torch 2.13 its embedding's graph fails in AOTAutograd
    ("Mixing fake modes NYI") with or without our pass."""
    spawn(tmp_path, 4, _fsdp_tp_worker, ("loss_parallel", "replicate"), AOT)


# ---------------------------------------------------------------------------------------------
# declines: the compile still succeeds, unfused and exact, and explain says why
# ---------------------------------------------------------------------------------------------
def _decline_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    cases = {
        # a prime vocabulary: uneven shards
        "uneven": (UNEVEN, lambda m: parallelize_module(m, mesh, {"lm_head": ColwiseParallel(use_local_output=False)}),
                   "loss_parallel", "vocabulary V=97 is not divisible by the 2 ranks"),
        # the weight sharded over D, not over the vocabulary
        "rowwise": (V, lambda m: parallelize_module(m, mesh, {"lm_head": RowwiseParallel(input_layouts=Replicate())}),
                    "replicate", "are not Shard(0) (the vocabulary) on one mesh dim"),
        # FSDP2 unit of its own: its hooks are graph breaks between the matmul and the loss
        "fsdp_head_unit": (V, lambda m: fsdp(m, mesh, head_unit=True), "replicate",
                           "a graph break separates the lm_head matmul from the loss"),
    }
    for name, (vocab, shard, spelling, reason) in cases.items():
        ids, labels = batch(0, vocab) if name != "fsdp_head_unit" else batch(rank, vocab)
        model = build(vocab=vocab)
        shard(model)
        with loss_context(spelling):
            report = inductor_xent.explain(lambda i, y, m=model: m(i, y), ids, labels)
            assert report.fused_count == 0 and report.declined_count == 1, (name, str(report))
            assert reason in report.sites[0].reason, (name, str(report))
            for p in model.parameters():
                p.grad = None
            fresh()
            loss = torch.compile(lambda i, y, m=model: m(i, y), backend="inductor_xent", options=AOT)(ids, labels)
            loss.backward()
        if name == "fsdp_head_unit":
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            assert_matches(loss, model, reference([batch(r, vocab) for r in range(world_size)], vocab=vocab))
        else:
            assert_matches(loss, model, reference([(ids, labels)], vocab=vocab))

    # ColwiseParallel() as is: every rank's cross_entropy sees only its own shard of the logits.
    # That is not the loss over the vocabulary, so it must not become the vocabulary-parallel op.
    ids, labels = batch(0)
    labels = labels.clamp(max=V // world_size - 1)  # valid class ids for a shard
    runs = []
    for enable in (True, False):
        model = build()
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
        fresh()
        loss = torch.compile(lambda i, y, m=model: m(i, y), backend="inductor_xent",
                             options={**AOT, "xent.enable": enable})(ids, labels)
        runs.append((loss.detach(), xent_counters()))
    assert runs[0][1].get("sites_fused", 0) == 0, runs[0][1]
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)


def test_declines_bad_layouts(tmp_path):
    spawn(tmp_path, 2, _decline_worker)


# ---------------------------------------------------------------------------------------------
# the rewrite of a DTensor site as text: one rank in this process (nothing to spawn or meet)
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def one_rank_mesh():
    """A gloo process group of one rank in this process and its 1-D mesh; destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded_head(x, W, y):
    """torchtitan's head: DTensor logits Shard(-1) of a Shard(0) weight, upcast, under loss_parallel."""
    z = F.linear(x, W).float()
    return F.cross_entropy(z.view(-1, z.shape[-1]), y.view(-1))


@pytest.mark.usefixtures("fresh_dynamo")
class TestPrintouts(expecttest.TestCase):
    """The graph before and after the pass (EXPECTTEST_ACCEPT=1 re-accepts; review the diff)."""

    def test_vocabulary_parallel_head(self):
        """The op on the DTensors (the vocabulary-parallel rule in distributed.py); its per-row loss
        taken to_local for the mean, which is replicated like the hidden states again at the end."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from .helpers import before_after, make_inputs

        ins = make_inputs()
        with one_rank_mesh() as mesh, loss_context("loss_parallel"):
            inputs = {"x": distribute_tensor(ins["x"], mesh, [Replicate()]),
                      "W": distribute_tensor(ins["W"], mesh, [Shard(0)]), "y": ins["y"]}
            text = before_after(_sharded_head, inputs)
        self.assertExpectedInline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "DTensor(f32[2, 7, 16], R)", L_W_: "DTensor(f32[37, 16], S(0))", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        linear: "DTensor(f32[2, 7, 37], S(2))" = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
        z: "DTensor(f32[2, 7, 37], S(2))" = linear.float();  linear = None
        view: "DTensor(f32[14, 37], S(1))" = z.view(-1, 37);  z = None
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        cross_entropy: "DTensor(f32[], R)" = torch.nn.functional.cross_entropy(view, view_1);  view = view_1 = None
        return (cross_entropy,)
# --- after the pass ---
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "DTensor(f32[2, 7, 16], R)", L_W_: "DTensor(f32[37, 16], S(0))", L_y_: "i64[2, 7]"):
        l_x_ = L_x_
        l_w_ = L_W_
        l_y_ = L_y_
        view_1: "i64[14]" = l_y_.view(-1);  l_y_ = None
        reshape: "DTensor(f32[14, 16], R)" = l_x_.reshape([-1, 16])
        linear_ce_fwd_default = torch.ops.inductor_xent.linear_ce_fwd.default(reshape, l_w_, None, view_1, -100, 0.0, 1.0, None, 0.0, skip_ignored = True);  reshape = l_w_ = None
        getitem: "DTensor(f32[14], R)" = linear_ce_fwd_default[0]
        to_local: "f32[14]" = getitem.to_local();  getitem = None
        getitem_1: "DTensor(f32[14], R)" = linear_ce_fwd_default[1];  linear_ce_fwd_default = None
        to_local_1: "f32[14]" = getitem_1.to_local();  getitem_1 = to_local_1 = None
        ne: "b8[14]" = view_1 != -100;  view_1 = None
        sum_1: "i64[]" = ne.sum();  ne = None
        sum_2: "f32[]" = to_local.sum();  to_local = None
        truediv: "f32[]" = sum_2 / sum_1;  sum_2 = sum_1 = None
        replicate_like: "DTensor(f32[], R)" = inductor_xent_distributed_replicate_like(truediv, l_x_);  truediv = l_x_ = None
        return (replicate_like,)
""")
