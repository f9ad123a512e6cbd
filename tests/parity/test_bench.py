"""The benchmark harness's decode rows (benchmarks/run.py) at CI size: its
full-size rows run on the GPU machine only, so here the Qwen3-MoE decode
row (`qwen3moe_decode512`) goes through the harness's own maker, export
and compile (`qwen3_moe`, `export_save`, `compile_for_gpu`,
`etmetal_bench`) with a tiny config of the same shape (8 experts routed
top-2, q/k norms, untied head), and the decode roofline's byte counts are
checked against the model's own parameters."""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# QWEN3_MOE's routing (8 experts, top-2, renormalised), q/k norms and untied
# head, every width cut down
TINY_MOE = {**bench.QWEN3_MOE, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 64}


def test_decode_roofline_counts_the_routed_experts_only():
    import transformers

    # the dense figures of the Llama rows, as before the MoE row
    assert bench.decoder_roofline_bytes(bench.LLAMA_1B, "bf16", 512) == {"weights": 2471632896,
                                                                         "kv_cache": 16809984}
    assert bench.decoder_roofline_bytes(bench.LLAMA_1B, "int4", 512) == {"weights": 772481024,
                                                                         "kv_cache": 16809984}
    # MoE, bf16: every parameter but the experts it does not route to and
    # the embedding rows it does not look up
    c = bench.QWEN3_MOE
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**c))
    params = sum(p.numel() for p in model.parameters())
    unrouted = c["num_hidden_layers"] * (c["num_experts"] - c["num_experts_per_tok"]) * 3 * \
        c["hidden_size"] * c["moe_intermediate_size"]
    unread_rows = (c["vocab_size"] - 1) * c["hidden_size"]
    got = bench.decoder_roofline_bytes(c, "bf16", bench.LLAMA_CTX, True)
    assert got["weights"] == 2 * (params - unrouted - unread_rows)
    assert got["kv_cache"] == 2 * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * \
        (bench.LLAMA_CTX + 1)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_qwen3moe_decode_row_is_one_gpu_partition_matching_eager(strict, etmetal, tmp_path, monkeypatch):
    """The harness's recipe export (strict, `export_save(recipe=True)`) and
    a non-strict one of the same module: in bf16 and int4, one GPU
    partition with no node on the CPU (the router's top-k, the sort of its
    int64 expert ids and the grouped expert products on the GPU; the only
    CPU calls are the recipe's `copy_` of its position counters, as for the
    Llama rows), run on this machine's GPU adapter against eager."""
    monkeypatch.setenv("ETMETAL_BIN", str(etmetal.binary))
    torch.manual_seed(bench.seed_of("qwen3moe_decode512"))
    module = bench.qwen3_moe(**TINY_MOE).eval()
    g = torch.Generator().manual_seed(1)
    xs = (torch.randint(0, TINY_MOE["vocab_size"], (1, 1), generator=g),
          torch.arange(bench.LLAMA_CTX, bench.LLAMA_CTX + 1))
    pt2 = tmp_path / "row.pt2"
    if strict:
        bench.export_save(module, xs, pt2, recipe=True)
    else:
        torch.export.save(torch.export.export(copy.deepcopy(module), xs, strict=False), str(pt2))
    with torch.no_grad():
        want = bench.as_tuple(module(*xs))[0]
    inputs = bench.write_inputs(xs, tmp_path / "in")
    weights = {}
    for dt, tolerance in (("bf16", 1e-2), ("int4", 0.15)):  # int4: its quantization error (about 0.07)
        pte = tmp_path / f"row.{dt}.pte"
        placed = bench.compile_for_gpu(pt2, pte, dt)
        assert (placed["partitions"], placed["cpu_nodes"]) == (1, 0), placed
        shown = subprocess.run([str(etmetal.binary), "inspect", "-v", str(pte)], capture_output=True, text=True,
                               check=True).stdout
        on_cpu = shown.split("on the CPU, by operator:")[-1].split("\n\n")[0].split()
        assert on_cpu == ["2", "aten::copy_"], shown
        weights[dt] = float(re.search(r"weights ([0-9.]+) KiB", shown).group(1))
        experts = re.findall(r"named data `(\S*experts\S*)`", shown)
        if dt == "int4":
            # the experts' stacked weights in int4 too, each routed row times
            # its expert's by gather_qmv: no float copy left (bf16: 610 KiB of
            # weights; int4 with float experts 499 KiB, with int4 ones 235)
            assert experts and all(re.search(r"\.int4(_scales|_zeros)?$", e) for e in experts), experts
            assert "gather_qmv" in shown, shown
            assert weights["int4"] < 0.45 * weights["bf16"], weights
        b = bench.etmetal_bench(pte, inputs, "auto", runs=1, warmup=0)
        assert b["device"].startswith("gpu"), b["device"]
        err = bench.rel_err(b["output_0"], want)
        assert err <= tolerance, f"{dt}: {err:.3g}"
