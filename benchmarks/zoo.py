"""The zoo sweep: every causal-LM class of transformers, built from a tiny config with random weights
(no hub downloads), compiled as ``lambda ids, labels: model(input_ids=ids, labels=labels).loss``.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` it reports: whether the model
constructs (tiny config, model, one eager float32 forward with labels giving a finite loss); how
many lm_head -> cross-entropy sites ``backend="inductor_xent"`` fused and why it declined the
others; and whether the compiled loss and every parameter gradient are within PyTorch's own error
(``err(compiled) <= 4 * err(torch) + 1e-6``, both against a float64 copy of the model; see ``check``).

    python benchmarks/zoo.py                      # the whole sweep (~12 minutes on 2 CPU cores)
    python benchmarks/zoo.py llama gpt2 mixtral   # some model types
    python benchmarks/zoo.py --json out.json      # also write the rows
    python benchmarks/zoo.py --no-nested-graph-breaks  # INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0: no nested graph breaks
    python benchmarks/zoo.py --no-dynamo-tuning   # INDUCTOR_XENT_DYNAMO_TUNING=0: Dynamo as torch ships it

The sweep runs as a user's program would: transformers is imported, then
``torch.compile(..., backend="inductor_xent")`` looks the backend up, which applies the Dynamo tuning
of ``INDUCTOR_XENT_DYNAMO_TUNING`` (inductor_xent/dynamo_tuning.py, ``tune_dynamo``), and each compiled call
runs inside the backend's ``DynamoScope`` (nested graph breaks unless
``INDUCTOR_XENT_NESTED_GRAPH_BREAKS=0``); the two flags above set those variables (default: as in the
environment). The
compiled run uses the real backend with ``options={"xent.inner": "aot_eager"}`` (AOTAutograd, no code
generation: the rewrite is the same, the run is fast on CPU); ``explain`` gives the reason of every
site that was not fused.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB = 131  # prime: unaligned, and large enough for every special token id we set (0..7)
BATCH, SEQ = 2, 12
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 16, 64, 2
EXPERTS, EXPERTS_PER_TOKEN = 4, 2

# config fields shrunk in every config that has them (name -> tiny value)
SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "hidden_dim",
                     "embedding_size", "embedding_dim", "emb_dim", "ple_embed_dim", "adapter_in_dim",
                     "adapter_input_size", "attention_hidden_size", "lru_width", "backbone_hidden_size"), HIDDEN),
    **dict.fromkeys(("intermediate_size", "n_inner", "d_inner", "d_ff", "dff", "dim_ff", "ffn_dim",
                     "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim", "feed_forward_size",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size", "intermediate_size_mlp", "expert_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size"), FFN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
                     "swa_num_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_head", "dim_head", "swa_head_dim", "attention_head_size", "kv_channels",
                     "attention_head_dim", "v_head_dim", "qk_head_dim"), HEAD_DIM),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"), EXPERTS_PER_TOKEN),
    **dict.fromkeys(("zero_expert_num",), 2),  # LongCat's identity experts
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 0),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 64),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    **dict.fromkeys(("index_head_dim",), 16),
    **dict.fromkeys(("index_n_heads",), 2),
    **dict.fromkeys(("index_topk",), 8),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    # Mamba-2 mixers: heads x head dim = expand (2) x hidden
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim"), 16),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads",
                     "n_mamba_heads"), 2),
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size"), 8),
    **dict.fromkeys(("mamba_dt_rank", "time_step_rank"), 4),
    **dict.fromkeys(("mamba_n_groups", "n_groups"), 1),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 8),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
                     "window_size"), 8),
    **dict.fromkeys(("num_nextn_predict_layers",), 0),
    **dict.fromkeys(("rotary_dim",), 8),
    **dict.fromkeys(("mamba_d_ssm",), 64),  # = mamba_n_heads x mamba_d_head
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                "num_decoder_layers", "num_encoder_layers", "num_blocks")
# names that mean "a probability of dropping something": zero, so eager and compiled runs see the same
# values while the model stays in training mode (what a compiled training step runs)
DROPOUT_WORDS = ("dropout", "pdrop", "drop_prob", "layerdrop", "dropout_p", "router_jitter_noise")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
             "sep_token_id": 3, "forced_eos_token_id": 2, "eod_token_id": 2}

# model_type -> config fields the generic rules cannot guess
_HYBRID_ATTN = dict(attention_hidden_size=2 * HIDDEN, attention_head_dim=HIDDEN)  # Zamba: attention on [h, h]
OVERRIDES: dict[str, dict] = {
    # one attention layer among the Mamba/recurrent ones (the defaults place the first one deeper)
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # two hybrid layers: the second ties its shared transformer to the first's (one alone trips the tie)
    "zamba": dict(layers_block_type=["linear_attention", "hybrid", "hybrid"], **_HYBRID_ATTN),
    "zamba2": dict(mamba_headdim=32, **_HYBRID_ATTN),
    "dory": dict(layer_types=None, num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                 n_recurrent_loops=1),
    # transformers 5.24 bugs: DbrxAttentionConfig lacks rope_theta, and clip_qkv=None crashes in clamp
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, kv_n_heads=KV_HEADS, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=FFN, moe_num_experts=EXPERTS, moe_top_k=EXPERTS_PER_TOKEN)),
    # mixers whose heads x head dim must equal expand x hidden (64)
    "mamba2": dict(num_heads=4, head_dim=16),
    # validators: an even number of KV heads, KV heads = heads, top-1 routing
    "diffllama": dict(num_key_value_heads=2),
    "zaya": dict(num_experts_per_tok=1),
    "dots3_note_text": dict(num_key_value_heads=HEADS, head_dim=16),  # SWA head_dim = qk_nope + qk_rope
    # mLSTM: qk and v dims are rounded up to multiples of 64
    "xlstm": dict(hidden_size=128, embedding_dim=128, mode="train", chunk_size=4),
    # default rope_parameters is {} but the model reads one entry per layer type
    "cohere_compass_text": dict(rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for t in ("full_attention", "sliding_attention")}),
    # the indexer's sizes default to None
    "qwen4_exp_text": dict(indexer_n_heads=HEADS, indexer_kv_heads=KV_HEADS, indexer_head_dim=HEAD_DIM,
                           indexer_budget=8, indexer_compress_ratio=2, hc_lowrank=8),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_shape=[4, 3],
                     axial_pos_embds_dim=[16, 16], local_attn_chunk_length=4),
}


# model_type -> what to do to the model after building it
SETUP = {
    "xmod": lambda model: model.set_default_language("en_XX"),  # language adapters: pick one
}
# model_type -> the sites a model has (one per lm_head; MusicGen's four codebook heads each its own)
SITES = dict.fromkeys(("musicgen", "musicgen_melody"), 4)
# model_type -> (ids, labels) from the (BATCH, SEQ) ones, for models whose inputs are shaped differently
INPUTS = {
    # one token stream per codebook: ids (batch x codebooks, seq), labels (batch, seq, codebooks)
    **dict.fromkeys(("musicgen", "musicgen_melody"), lambda ids, labels: (
        ids.repeat_interleave(4, 0), labels.unsqueeze(-1).expand(-1, -1, 4).contiguous())),
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_kind(value) -> bool:
    return value is None or isinstance(value, (str, bool))


def _kept_layers(defaults: dict, layers: Optional[int]) -> list[int]:
    """Which layers of the default config the tiny one keeps: the first ``LAYERS``, plus the first layer
    of every kind a per-layer list names (a hybrid model keeps one attention layer, one MoE layer...)."""
    if not layers:
        return []
    keep = list(range(min(LAYERS, layers)))
    for value in defaults.values():
        if isinstance(value, list) and len(value) == layers and all(map(_is_kind, value)):
            for kind in dict.fromkeys(value):
                if not any(value[i] == kind for i in keep):
                    keep.append(value.index(kind))
    return sorted(keep)


def _shrink(defaults: dict, layers: Optional[int]) -> dict:
    """Tiny values for the fields of one (sub)config, from its default values."""
    keep = _kept_layers(defaults, layers)
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if isinstance(value, bool):
            continue
        if "vocab" in key and isinstance(value, int):  # vocab_size, vocab_size_per_layer_input, ...
            if value > VOCAB:
                out[key] = VOCAB
        elif key in LAYER_COUNTS and isinstance(value, int):
            out[key] = len(keep) if keep and value == layers else min(value, LAYERS)
        elif key in SIZES and (value is None or isinstance(value, int)):
            out[key] = SIZES[key]  # None: a size the config leaves to the user (head_dim of some)
        elif key in SIZES and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [SIZES[key]] * len(keep) if len(value) == layers else [SIZES[key]]
        elif any(w in key for w in DROPOUT_WORDS) and isinstance(value, (int, float)):
            out[key] = type(value)(0)
        elif key in TOKEN_IDS and value is not None:
            out[key] = TOKEN_IDS[key] if isinstance(value, int) else [TOKEN_IDS[key]]
        elif isinstance(value, list) and layers and len(value) == layers:
            out[key] = [value[i] for i in keep]  # per-layer lists (layer_types, ...)
        elif key == "per_layer_config" and isinstance(value, dict):  # {"05": {...}}: layer index -> fields
            out[key] = {f"{keep.index(int(k)):0{len(k)}d}" if isinstance(k, str) else keep.index(int(k)):
                        {**v, **_shrink(v, None)} for k, v in value.items() if int(k) in keep}
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: rope on a slice; as many KV heads as heads
        if "head_dim" in defaults:
            out["head_dim"] = out["qk_rope_head_dim"]
        if "num_key_value_heads" in defaults:
            out["num_key_value_heads"] = HEADS
    return out


def _layers(d: dict) -> Optional[int]:
    return next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)


def _tiny(defaults: dict, model_type: str) -> dict:
    """The tiny fields of one (sub)config: the generic rules, then ``OVERRIDES[model_type]``."""
    kwargs = _shrink(defaults, _layers(defaults))
    for key, value in defaults.items():  # sub-configs (text_config, ...)
        if isinstance(value, dict) and key.endswith(("config", "encoder", "decoder")) and value \
                and key != "per_layer_config":
            sub = _tiny(value, value.get("model_type", ""))
            shrunk = {k: v for k, v in sub.items() if v != value.get(k)}
            if shrunk:
                kwargs[key] = {**value, **shrunk}
    for key, value in OVERRIDES.get(model_type, {}).items():
        kwargs[key] = {**kwargs[key], **value} if isinstance(kwargs.get(key), dict) else value
    for fields in kwargs.get("per_layer_config", {}).values():  # per-layer exceptions: the tiny global values
        fields.update({k: kwargs[k] for k in fields if k in kwargs})
    return kwargs


def tiny_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    return config_class(**_tiny(config_class().to_dict(), model_type))


def build(model_type: str, seed: int = 0, dtype=torch.float32):
    """(model, ids, labels) for ``model_type``: random weights from a tiny config, training mode."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if not isinstance(config, model_class.config_class):  # a composite config: the decoder's part
        config = next((v for v in vars(config).values() if isinstance(v, model_class.config_class)), config)
    model = model_class._from_config(config).to(dtype)
    model.train()
    if dtype == torch.float64 and model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(8, VOCAB, (BATCH, SEQ), generator=g)  # above the special token ids
    labels = ids.clone()
    labels[0, -3:] = -100  # padding
    if model_type in SETUP:
        SETUP[model_type](model)
    if model_type in INPUTS:
        ids, labels = INPUTS[model_type](ids, labels)
    return model, ids, labels


def loss_fn(model):
    return lambda ids, labels: model(input_ids=ids, labels=labels).loss


@dataclass
class Row:
    model_type: str
    model_class: str = ""
    constructs: bool = False
    error: str = ""  # why it does not construct, or why the compiled run failed
    fused: int = 0
    declined: int = 0
    graphs: int = 0
    reasons: list = field(default_factory=list)  # one per declined site
    loss_err: Optional[float] = None  # err(compiled) / (4 err(eager) + 1e-6): <= 1 is within torch's error
    grad_err: Optional[float] = None  # the worst parameter gradient's ratio
    exact: Optional[bool] = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.constructs and self.fused == SITES.get(self.model_type, 1) and self.declined == 0
                and bool(self.exact))


def _loss_and_grads(model, fn, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = fn(ids, labels)
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _ratio(ours, torch_results, exact, floor) -> float:
    """err(ours) / (4 max err(torch) + floor), errors against ``exact``: <= 1 is within torch's own error."""
    from benchmarks.accuracy import rel_err

    return rel_err(ours, exact) / (4.0 * max(rel_err(t, exact) for t in torch_results) + floor)


def _reference(model_type, ids, labels, eager):
    """(loss, grads, floor): the float64 model's when it runs, else eager float32's (then every error is
    measured against eager, and the floor is float32's resolution on these sizes)."""
    try:
        ref, _, _ = build(model_type, dtype=torch.float64)  # the same weights (same seed), in float64
        return (*_loss_and_grads(ref, loss_fn(ref), ids, labels), 1e-6)
    except Exception:  # noqa: BLE001 - a model with hard-coded float32 buffers or masks
        return (*eager, 1e-5)


def _compiled(model, ids, labels, enable: bool):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss_fn(model), backend="inductor_xent",
                             options={"xent.inner": "aot_eager", "xent.enable": enable})
    return _loss_and_grads(model, compiled, ids, labels)


def check(model_type: str, explain_declines: bool = True) -> Row:
    """Build, run eagerly in float32 and float64, compile with inductor_xent, compare.

    The loss and every gradient must be within torch's own error: ``err(ours) <= 4 err(torch) + floor``
    against float64, where err(torch) is the larger of eager float32's and torch.compile's without our
    pass (a few architectures' gradients move under torch.compile alone, by up to 30x eager's error)."""
    from torch._dynamo.utils import counters
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import inductor_xent

    row = Row(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    start = time.perf_counter()
    try:
        model, ids, labels = build(model_type)
        le, ge = _loss_and_grads(model, loss_fn(model), ids, labels)
        if not torch.isfinite(le):
            raise RuntimeError(f"eager loss is {le.item()}")
    except Exception as e:  # noqa: BLE001 - a model that cannot be built from a tiny config: counted apart
        row.error = _short(e)
        row.seconds = time.perf_counter() - start
        return row
    row.constructs = True
    try:
        l64, g64, floor = _reference(model_type, ids, labels, (le, ge))
        lc, gc = _compiled(model, ids, labels, enable=True)
        row.graphs = counters["stats"]["unique_graphs"]
        row.fused = counters["inductor_xent"]["sites_fused"]
        row.declined = counters["inductor_xent"]["sites_declined"]
        torch_results = ([le], {k: [ge[k]] for k in ge})

        # a gradient far smaller than the others (vanishing through a recurrence: 1e-7 of the whole) is
        # held to the floor of the whole gradient, not to its own tiny norm
        total = math.sqrt(sum(g64[k].double().norm().item() ** 2 for k in ge))

        def ratios():
            return (_ratio(lc, torch_results[0], l64, floor),
                    max((_ratio(gc[k], torch_results[1][k], g64[k],
                                floor * max(1.0, total / max(g64[k].double().norm().item(), 1e-30))) for k in ge),
                        default=0.0))

        row.loss_err, row.grad_err = ratios()
        if max(row.loss_err, row.grad_err) > 1.0:  # is torch.compile alone as far off?
            lp, gp = _compiled(model, ids, labels, enable=False)
            torch_results[0].append(lp)
            for k in ge:
                torch_results[1][k].append(gp[k])
            row.loss_err, row.grad_err = ratios()
        row.exact = set(gc) == set(ge) and row.loss_err <= 1.0 and row.grad_err <= 1.0
        if explain_declines and (row.fused != SITES.get(model_type, 1) or row.declined):
            report = inductor_xent.explain(loss_fn(model), ids, labels)
            row.reasons = [s.reason for s in report.sites if not s.fused]
            if not report.sites:
                row.reasons = ["no lm_head matmul -> cross-entropy site found"
                               + (f" ({report.graph_break_count} graph break(s))" if report.graph_break_count else "")]
    except Exception as e:  # noqa: BLE001 - reported in the table
        row.error = _short(e)
    finally:
        torch._dynamo.reset()
    row.seconds = time.perf_counter() - start
    return row


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def construct_only(model_type: str) -> Row:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    row = Row(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    start = time.perf_counter()
    try:
        model, ids, labels = build(model_type)
        le, _ = _loss_and_grads(model, loss_fn(model), ids, labels)
        if not torch.isfinite(le):
            raise RuntimeError(f"eager loss is {le.item()}")
        row.constructs = True
    except Exception as e:  # noqa: BLE001
        row.error = _short(e)
        if "-v" in sys.argv:
            traceback.print_exc()
    row.seconds = time.perf_counter() - start
    return row


def table(rows: list[Row]) -> str:
    cols = ("model_type", "class", "builds", "fused", "declined", "graphs", "exact", "loss/grad err", "s", "reason")
    lines = [cols]
    for r in rows:
        errs = "" if r.loss_err is None else f"{r.loss_err:.2f}/{r.grad_err:.2f}"
        reason = r.error or "; ".join(r.reasons)
        lines.append((r.model_type, r.model_class, "yes" if r.constructs else "no",
                      str(r.fused) if r.constructs else "", str(r.declined) if r.constructs else "",
                      str(r.graphs) if r.constructs else "", "" if r.exact is None else ("yes" if r.exact else "NO"),
                      errs, f"{r.seconds:.1f}", reason))
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def summary(rows: list[Row]) -> str:
    built = [r for r in rows if r.constructs]
    ok = [r for r in built if r.ok]
    pct = 100.0 * len(ok) / len(built) if built else math.nan
    lines = [f"{len(rows)} causal-LM model types; {len(built)} construct; {len(ok)} of them fuse every site "
             f"(SITES: one, or one per codebook head) with loss and grads within torch's error ({pct:.1f}%); "
             f"{len(built) - len(ok)} do not; "
             f"{len(rows) - len(built)} do not construct; {sum(r.seconds for r in rows):.0f} s"]
    misses: dict[str, list[str]] = {}
    for r in built:
        if not r.ok:
            why = r.error or "; ".join(r.reasons) or ("not within torch's error" if not r.exact else
                                                       f"{r.fused} sites fused")
            misses.setdefault(why.split(":")[0].split(" (")[0][:90], []).append(r.model_type)
    for why, types in sorted(misses.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(types):3d}  {why}: {', '.join(types)}")
    return "\n".join(lines)


def _ignores_warning_once() -> bool:
    from inductor_xent import dynamo_tuning

    fn = dynamo_tuning.transformers_warning_once()
    return fn is not None and fn in torch._dynamo.config.ignore_logging_functions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("types", nargs="*", help="model types (default: all)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--construct-only", action="store_true", help="only build and run eagerly")
    p.add_argument("-v", action="store_true", help="tracebacks of failures")
    p.add_argument("--dynamo-tuning", action=argparse.BooleanOptionalAction, default=None,
                   help="INDUCTOR_XENT_DYNAMO_TUNING=1/0: Dynamo skips transformers' warning_once (the "
                        "loss_type warning) or breaks the graph on it (default: the environment's, else on)")
    p.add_argument("--nested-graph-breaks", action=argparse.BooleanOptionalAction, default=None,
                   help="INDUCTOR_XENT_NESTED_GRAPH_BREAKS=1/0: the backend's calls traced with "
                        "torch._dynamo.config.nested_graph_breaks = True (what the breaks inside forward need) or "
                        "as torch ships it (default: the environment's, else on)")
    args = p.parse_args(argv)
    for name, value in (("INDUCTOR_XENT_DYNAMO_TUNING", args.dynamo_tuning),
                        ("INDUCTOR_XENT_NESTED_GRAPH_BREAKS", args.nested_graph_breaks)):
        if value is not None:
            os.environ[name] = "1" if value else "0"
    warnings.filterwarnings("ignore")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the .item() graph-break advice, per model
    import transformers

    from inductor_xent import config

    transformers.logging.set_verbosity_error()
    types = args.types or causal_lm_types()
    rows = []
    for t in types:
        row = construct_only(t) if args.construct_only else check(t)
        rows.append(row)
        print(f"{row.model_type:28s} {'ok' if row.ok else '--'} {row.seconds:6.1f}s "
              f"{row.error or '; '.join(row.reasons)}", file=sys.stderr, flush=True)
    print(table(rows))
    print(summary(rows))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"INDUCTOR_XENT_DYNAMO_TUNING={int(config.dynamo_tuning())} (Dynamo ignores transformers' warning_once: "
          f"{_ignores_warning_once()}), INDUCTOR_XENT_NESTED_GRAPH_BREAKS={int(config.nested_graph_breaks())} "
          f"(nested graph breaks in the backend's calls only)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
