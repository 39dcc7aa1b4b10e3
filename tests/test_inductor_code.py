"""The code Inductor generates for a fused site (CPU: C++ kernels and a Python wrapper), read with
FileCheck: the forward calls our op once and the backward our backward op once, and neither holds
an [N, V] matmul or buffer. The same markers, searched in the code of ``backend="inductor"`` (no
pass), must be there: so the checks fail on an unfused graph instead of passing on any text.

Sizes are helpers' (N = B·T = 14 rows, V = 37): the logits are (14, 37), or (2, 7, 37) before
their view; no other tensor of these graphs has either shape. Six compiles: ~25 s in all on 2 cores
with an empty Inductor cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from inductor_xent import ops

from .helpers import B, T, V, leaves, make_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# what the wrapper code of an unfused site writes: the lm_head matmul as an extern kernel call (mm,
# addmm, bmm: "extern_kernels." appears nowhere else; its import line has no dot after it), and
# buffers and size asserts of the logits' shape
MATMUL = "extern_kernels."
LOGITS = (f"({B * T}, {V})", f"({B}, {T}, {V})")


def _hf_causal_lm(x, W, y, **_):
    """transformers' ForCausalLMLoss: ``F.cross_entropy(logits.float().view(-1, V), labels.view(-1))``."""
    return F.cross_entropy(F.linear(x, W).float().view(-1, V), y.view(-1))


def _log_probs(x, W, yv, **_):
    """TRL / verl: the log-probs of the sampled tokens at a temperature, through gather."""
    z = F.linear(x, W).float() / 0.7
    return torch.gather(F.log_softmax(z, -1), -1, yv.unsqueeze(-1)).squeeze(-1)


def _softcap(x, W, y, **_):
    """Gemma 2's final_logit_softcapping: div -> tanh -> mul, then .float()."""
    return F.cross_entropy((torch.tanh(F.linear(x, W) / 2.0) * 2.0).float().view(-1, V), y.view(-1))


# name -> (fn, the forward op, the backward op)
SPELLINGS = {
    "hf_causal_lm": (_hf_causal_lm, ops.FORWARD, ops.BACKWARD),
    "log_probs_gather": (_log_probs, ops.FORWARD, ops.BACKWARD),
    "softcap": (_softcap, ops.FORWARD, ops.BACKWARD),
}


def _code(fn, backend) -> list[str]:
    """The forward's and the backward's wrapper code Inductor writes for ``fn`` (one graph)."""
    ins = leaves(make_inputs())
    compiled = torch.compile(fn, backend=backend)
    _, code = run_and_get_code(lambda: compiled(**ins).sum().backward())
    assert len(code) == 2, f"{len(code)} modules: expected one forward and one backward"
    return code


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_generated_code_calls_the_op_and_holds_no_logits(name):
    fn, *fused_ops = SPELLINGS[name]
    for code, op in zip(_code(fn, "inductor_xent"), fused_ops):
        check = FileCheck()
        for marker in (MATMUL, *LOGITS):  # before the op's call and after it: the whole module
            check.check_not(marker)
        check.check_count(f"torch.ops.{op}(", 1, exactly=True)
        for marker in (MATMUL, *LOGITS):
            check.check_not(marker)
        check.run(code)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_checks_find_the_logits_without_the_pass(name):
    """backend="inductor": the matmul and the (N, V) logits in the forward and in the backward (whose
    gradient of the logits is an mm too), and none of our ops."""
    fn, *_ = SPELLINGS[name]
    for code in _code(fn, "inductor"):
        FileCheck().check(f"{MATMUL}mm(").run(code)
        FileCheck().check(LOGITS[0]).run(code)
        FileCheck().check_not("torch.ops.inductor_xent").run(code)
