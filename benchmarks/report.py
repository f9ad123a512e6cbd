"""Write BENCHMARKS.md (and ratios.png where matplotlib imports) from
benchmarks/results/{gpu,cpu}.json. Run through `run.py report`."""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
PNG = HERE / "ratios.png"
# H200 SXM leads from the datasheet (plain f32, dense bf16 tensor cores, HBM3e);
# int4 rows compute in bf16.
PEAK = {"f32": 67e12, "bf16": 990e12, "int4": 990e12}
# HBM datasheet bandwidth per card (H200 HBM3e, H100 SXM HBM3)
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12}
# the decode issue's roofline bandwidth per card: what a device-to-device
# copy reaches on the H200; the H100's datasheet HBM3 figure (no copy was
# measured there, and the datasheet is the stricter bound)
ROOFLINE_BW = {"H200": 4.3e12, "H100": 3.35e12}


def load(name):
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def f(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 10 ** -digits or v == 0 else f"{v:.1e}"
    return str(v)


def fs(row, key, digits=3):
    """`row[key]` with its spread over the repeated measurements, where the
    row has one (`key_spread`: [min, max])."""
    v, spread = row.get(key), row.get(f"{key}_spread")
    if v is None or not spread:
        return f(v, digits)
    return f"{f(v, digits)} ({f(spread[0], digits)}–{f(spread[1], digits)})"


def mib(n):
    return "–" if n is None else f"{n / 2**20:.1f}"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


def ratio(a, b):
    return a / b if a is not None and b else None


def op_rows(gpu):
    rows, ratios = [], []
    for o in gpu["ops"]:
        if "error" in o:
            rows.append([o["op"], o["dtype"], run_of(o), "error: " + o["error"].splitlines()[-1][:120]] + [""] * 8)
            continue
        k, t = o["etmetal_kernel_ms"], o["torch_ms"]
        r = ratio(k, t)
        # (results before the `bound` field: the one-query SDPA)
        memory_bound = o.get("bound", "memory" if o["op"].startswith("sdpa_1x") else "compute") == "memory"
        if memory_bound:
            # (PyTorch's int4 rows move a bf16 weight: `torch_bytes`)
            rate = lambda ms, b=o["bytes"]: None if ms is None else b / (ms * 1e-3) / 1e9  # noqa: E731
            bw = PEAK_BW.get(card_of(o))
            peak = lambda ms: None if ms is None or bw is None else o["bytes"] / (ms * 1e-3) / bw  # noqa: E731
            torch_rate = rate(t, o.get("torch_bytes", o["bytes"]))
            unit = "GB/s"
        else:
            rate = lambda ms: None if ms is None else o["flops"] / (ms * 1e-3) / 1e12  # noqa: E731
            peak = lambda ms: None if ms is None else o["flops"] / (ms * 1e-3) / PEAK[o["dtype"]]  # noqa: E731
            torch_rate = rate(t)
            unit = "TFLOP/s"
        rows.append([o["op"], o["dtype"], run_of(o), fs(o, "torch_ms"), fs(o, "etmetal_kernel_ms"), f(r, 2),
                     f"{f(rate(k), 1)} / {f(torch_rate, 1)} {unit}",
                     f(None if peak(k) is None else 100 * peak(k), 1), fs(o, "etmetal_e2e_ms"), o["dispatches"],
                     f(o["err"], 1)])
        if r is not None:
            ratios.append((f"{o['op']} {o['dtype']}", r))
    return rows, ratios


def model_rows(gpu):
    rows, ratios = [], []
    for m in gpu["models"]:
        if "error" in m:
            rows.append([m["model"], m["dtype"], run_of(m), "error: " + m["error"].splitlines()[-1][:120]] + [""] * 13)
            continue
        r = ratio(m["etmetal_e2e_ms"], m["torch_e2e_ms"])
        top = m["top_kernels"][0] if m["top_kernels"] else None
        placed = f"{m.get('partitions', '–')} / {m.get('kernels', '–')} / {m.get('cpu_nodes', '–')}"
        compiled = fs(m, "torch_compile_ms") if "torch_compile_error" not in m else \
            "error: " + m["torch_compile_error"][:60]
        rows.append([m["model"], m["dtype"], run_of(m), mib(m["weight_bytes"]), fs(m, "torch_ms"), compiled,
                     fs(m, "torch_e2e_ms"), fs(m, "torch_compile_e2e_ms"), fs(m, "etmetal_kernel_ms"),
                     fs(m, "etmetal_e2e_ms"), f(r, 2),
                     f(ratio(m["etmetal_kernel_ms"], m.get("torch_compile_ms")), 2), roofline(m), placed,
                     m["dispatches"], "–" if top is None else f"{top['kernel']} {100 * top['share']:.0f}%",
                     f(m.get("err"), 1)])
        if r is not None:
            ratios.append((f"{m['model']} {m['dtype']}", r))
    return rows, ratios


def card_of(row) -> str:
    """The row's card, short (`H100`)."""
    return row.get("card", "").replace("NVIDIA ", "").split(" ")[0]


def roofline(m):
    """A decode step's roofline (its weight and KV-cache bytes over its
    card's ROOFLINE_BW) and etmetal's kernel time's % of it; – for other
    rows and unknown cards."""
    b = m.get("roofline_bytes")
    bw = ROOFLINE_BW.get(card_of(m))
    if not b or bw is None:
        return "–"
    ms = (b["weights"] + b["kv_cache"]) / bw * 1e3
    pct = ratio(ms, m["etmetal_kernel_ms"])
    # an MoE step's weight bytes count only the experts it routes to
    experts = " ({} of {} experts)".format(*b["active_experts"]) if b.get("active_experts") else ""
    return f"{ms:.3f} ms{experts}, {f(None if pct is None else 100 * pct, 1)}%"


def chart(op_ratios, model_ratios):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    items = [(n, r, "op (GPU kernel time)") for n, r in op_ratios] + \
            [(n, r, "model (end to end)") for n, r in model_ratios]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(items) + 1.5))
    colours = {"op (GPU kernel time)": "tab:blue", "model (end to end)": "tab:orange"}
    ax.barh([n for n, _, _ in items], [r for _, r, _ in items], color=[colours[k] for _, _, k in items])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("etmetal time / PyTorch eager CUDA time (log; < 1 is faster)")
    ax.set_title("etmetal vs PyTorch on one H200")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()], loc="lower right")
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)
    return True


INT4 = ("int4 rows: bf16 activations (M = 1), the weight compiled with `--quantize int4 --group-size 32`; "
        "their bytes are the packed weight, scales and zeros, activations and output, and PyTorch does the "
        "same product in bf16 with a float weight of the same shape (err against the float weight: the "
        "quantization error included). ")
LLAMA = ("The Llama-3.2-1B shape (16 layers, hidden 2048, 32/8 heads, MLP 8192, vocabulary 128256, untied "
         "head, random weights, transformers' static-cache recipe with 1024 positions): a decode step at "
         "position 512 and a 512-token prefill, in bf16 and int4 (PyTorch runs bf16 for both); roofline: the "
         "weight bytes the step reads (the embedding one row) plus the K and V cache of 513 positions, over "
         "4.3 TB/s on the H200 (what a device-to-device copy reaches there) or the H100's datasheet 3.35 TB/s, "
         "and etmetal's kernel time's % of it. ")
QWEN3_MOE = ("The Qwen3-MoE shape (`qwen3moe_decode512`: Qwen3-30B-A3B's layer, hidden 2048, 32/4 heads of "
             "128 with q/k norms, 8 experts of 768 routed top-2, 6 layers, untied head over 151936 tokens, "
             "random weights, the same recipe and step): its roofline counts the router and only the 2 "
             "routed experts of each layer (marked '2 of 8 experts'); int4 quantizes the linears and the "
             "experts (routed by gather_qmv). ")


def run_of(row) -> str:
    """The run a row comes from (`run.py merge` folds several into one
    file): its date and card, and `events` where PyTorch's figure was CUDA
    events around each call (launch overhead included) and each figure one
    measurement, as before the profiler timing."""
    run = f"{row.get('run', '–')} {card_of(row)}".strip()
    if row.get("torch_timing", "events") == "profiler":
        return run
    return f"{run} (events)"


def rows_of(results) -> list:
    return results.get("ops", []) + results.get("models", [])


def repeats(results) -> str:
    """What the figures are medians of (per row where runs were merged)."""
    ns = {r.get("repeat", results.get("repeat")) for r in rows_of(results)} or {results.get("repeat")}
    if ns == {None} or ns == {1}:
        return "Each figure is one measurement (results from before the harness repeated them)."
    n = max(x for x in ns if x)
    also = " (rows marked `events` in the run column: one measurement)" if len(ns) > 1 else ""
    return f"Each figure is the median of {n} separate measurements, with their (min–max){also}."


PROFILER = ("the CUDA kernel time torch.profiler records over the runs, per call (no launch overhead; "
            "torch.compile likewise)")
EVENTS = "CUDA events around each call (launch overhead included; results from before the profiler timing)"


def torch_timing(gpu) -> str:
    kinds = {r.get("torch_timing", gpu.get("torch_timing", "events")) for r in rows_of(gpu)}
    if kinds == {"profiler"}:
        return PROFILER
    if "profiler" in kinds:
        return f"{PROFILER}; rows marked `events` in the run column: {EVENTS}"
    return EVENTS


def dynamic_section(gpu) -> list:
    """The bounded-dynamic rows (`run.py gpu --only dyn_`): one program
    compiled with a dynamic size against a static one compiled for each size."""
    dyn = gpu.get("dynamic") or []
    if not dyn:
        return []
    rows = []
    for r in dyn:
        if "error" in r:
            rows.append([r["model"], "–", "–", "error: " + r["error"].splitlines()[-1][:120]] + [""] * 7)
            continue
        rows.append([r["model"], r["size"], r["bound"], fs(r, "static_etmetal_kernel_ms"),
                     fs(r, "dynamic_etmetal_kernel_ms"), f(r["kernel_ratio"], 2), fs(r, "static_etmetal_e2e_ms"),
                     fs(r, "dynamic_etmetal_e2e_ms"), f(r["e2e_ratio"], 2),
                     f"{r['static_dispatches']} / {r['dynamic_dispatches']}", f(r["dynamic_vs_static_err"], 1)])
    return ["### Bounded dynamic shapes: one program for every size vs a static program per size", "",
            "One program exported with a dynamic size (`torch.export.Dim` up to the bound) and compiled once, "
            "beside a program exported and compiled for each size, the same inputs (Llama-shaped prefill: "
            "the 1B widths with 4 layers, bf16, transformers' static-cache recipe; ResNet-18 f32). ratio: "
            "dynamic / static (the dynamic-shapes issue asks for at most 1.10). err: ‖dynamic − static‖ / "
            "‖static‖.", "",
            table(["model", "size", "bound", "static kernel ms", "dynamic kernel ms", "kernel ratio",
                   "static e2e ms", "dynamic e2e ms", "e2e ratio", "dispatches static / dynamic", "err"], rows), ""]


def host_path_section():
    """BENCHMARKS.md's host-path section, from results/host_path.json
    (benchmarks/host_path.py); empty where that file is missing."""
    r = load("host_path")
    if not r:
        return []
    mach = r["machine"]
    rows = [[row["dtype"], mib(row["bytes"]) if row["bytes"] >= 1 << 20 else f"{row['bytes'] >> 10} KiB",
             f(row["etmetal_e2e_ms"]), f(row["etmetal_kernel_ms"]), f(row["etmetal_host_ms"]),
             f(row["torch_copies_ms"]), f(row["host_over_torch"], 2)] for row in r["rows"]]
    return ["## Host path: an execute's host work vs PyTorch's copies", "",
            f"`benchmarks/host_path.py` on {mach.get('gpu', 'no GPU')} ({mach['cores']} cores, PyTorch "
            f"{mach['torch']}): `etmetal run --bench` of `x * 1` compiled for the GPU (median end to end of one "
            "`Method::execute`; host = end to end minus the kernel's timestamp time) beside PyTorch's "
            "`x.cuda()` + `.cpu()` of a pageable host tensor of the same bytes (median wall time). "
            "Below 1 in the last column: etmetal's host work takes less time than PyTorch's two copies.", "",
            table(["dtype", "MiB", "etmetal e2e ms", "etmetal kernel ms", "etmetal host ms",
                   "PyTorch copies ms", "host / PyTorch"], rows), ""]


def binaries_section():
    """BENCHMARKS.md's kernel-change section, from results/binaries*.json
    (benchmarks/binaries.py: one row compiled and run by several binaries
    in one run on one card); empty where there is none."""
    md = []
    for path in sorted(RESULTS.glob("binaries*.json")):
        r = json.loads(path.read_text())
        card = r["machine"].get("nvidia_smi") or r["machine"].get("gpu")
        rows = []
        for row in r["rows"]:
            if "error" in row:
                rows.append([row["row"], row["binary"], "error: " + row["error"][:80], "", "", "", ""])
                continue
            top = sorted(row["families"].items(), key=lambda x: -x[1])[:3]
            # (a binary run with other tensor-core settings than auto says so)
            binary = row["binary"] + ("" if row.get("coop", "auto") == "auto" else f" (--coop {row['coop']})")
            rows.append([row["row"], binary, fs(row, "gpu_ms"), fs(row, "e2e_ms"), row["dispatches"],
                         mib(row["size"]), ", ".join(f"{k} {v:.3f}" for k, v in top)])
        what = "; ".join(f"`{k}`: {v}" for k, v in r["binaries"].items())
        md += [f"### `{path.name}`", "",
               f"{r['run']}, {card}. Binaries: {what}." + (f" {r['note']}." if r.get("note") else ""), "",
               table(["row", "binary", "GPU ms", "end to end ms", "dispatches", "MiB", "largest kernel families, ms"],
                     rows), ""]
    if not md:
        return []
    return ["## Kernel changes: binaries side by side", "",
            "`benchmarks/binaries.py`: each row (`run.py`'s model cases, `MODEL:DTYPE[:FLAGS]`) exported once and "
            "compiled and run by each binary in the same run on the same card; medians of REPEAT `etmetal run "
            "--bench` sessions with their [min, max]; kernel families summed over the step (first session).", "",
            *md]


def first_load_section():
    """BENCHMARKS.md's first-load section, from results/first_load.json
    (benchmarks/first_load.py: what `--coop auto`'s measured choice costs a
    load); empty where that file is missing."""
    r = load("first_load")
    if not r:
        return []
    card = r["machine"].get("nvidia_smi", "no GPU")
    rows = []
    for m in r["rows"]:
        if "configs" not in m:
            continue
        for name, c in m["configs"].items():
            w, e = c["wall_ms"], c["execute_ms"]
            extra = m.get("extra_wall_vs_off_ms", {}).get(name)
            rows.append([m["model"], m["dtype"], name, f"{w['median']:.0f} ({w['min']:.0f}–{w['max']:.0f})",
                         f"{e['median']:.2f}", "" if extra is None else f"{extra:+.0f}",
                         max(c.get("coop_dispatches") or [0])])
    warm = [f"{m['model']}: {m['driver_warmup']['off']['wall_ms'] / 1000:.1f} s portable, "
            f"{m['driver_warmup']['nocache']['wall_ms'] / 1000:.1f} s with every form measured"
            for m in r["rows"] if "driver_warmup" in m]
    spans = [f"{m['model']} {m['traced']['cold']['measure_ms']:.0f} ms cold, {m['traced']['warm']['measure_ms']:.0f} "
             "ms warm" for m in r["rows"] if m.get("traced", {}).get("cold", {}).get("measure_ms") is not None]
    return ["## First load: what the measured choice of tensor-core forms costs", "",
            f"`benchmarks/first_load.py`, {r['run']}, {card}: one `etmetal run` process (start to exit, the first "
            f"execute included), median of {r['repeat']} with (min–max), per configuration: `off` (`--coop off`, "
            "nothing measured), `nocache` (`--coop auto`, `ETMETAL_TUNING_CACHE=off`: every load measures), `cold` "
            "(`--coop auto`, an empty tuning cache: the first load of a payload on a device) and `warm` (the "
            "same cache again: nothing measured). The driver's own shader cache is warmed first for all; its "
            "cold first loads took " + "; ".join(warm) + " (every form's pipeline compiled by the driver once "
            "per machine). The measuring span of `ETMETAL_TRACE`: " + "; ".join(spans) + ".", "",
            table(["model", "dtype", "config", "wall ms", "first execute ms", "vs off ms", "tensor-core dispatches"],
                  rows), ""]


def flash_variants_section():
    """BENCHMARKS.md's flash-attention section, from
    results/flash_variants_*.json (each 16x16 variant forced in turn with
    `ETMETAL_COOP_FORCE`, as benchmarks/variants.py does; each file's
    `binary` and `forms` say what was built: a file may hold forms of a
    diagnostic build that leave parts of the kernel out, and PyTorch's time
    on the same rows in the same run); empty where there is none."""
    md = []
    for path in sorted(RESULTS.glob("flash_variants*.json")):
        r = json.loads(path.read_text())
        seen, rows = set(), []
        for row in r["rows"]:
            key = (row["op"], row["variant"], row["form"])
            if key in seen:  # (a form timed again in a later call of the run)
                continue
            seen.add(key)
            variant = "portable" if row["variant"] is None else f"{row['variant']}: {r['variants'][row['variant']]}"
            rows.append([f"{row['op']} {row['dtype']}", variant, row["form"], f(row["attention_ms"]),
                         f(row["total_ms"]), f"{row['err']:.1e}"])
        forms = "; ".join(f"`{k}`: {v}" for k, v in r["forms"].items())
        # PyTorch and the earlier build on the same rows, where the run timed them
        beside = "".join(
            f" {op}: PyTorch {f(ms)} ms, earlier build {f(r.get('main_before_ms', {}).get(op))} ms (all kernels);"
            for op, ms in r.get("torch_ms", {}).items())
        same_run = f" Same run ({r['torch_note']}):{beside}" if beside else ""
        md += [f"### `{path.name}`", "",
               f"{r['run']}, {r['machine']['nvidia_smi']}. Binary: {r['binary']}. Forms: {forms}. Kernel time "
               "(median of 10 profiled executes): the attention kernel, and every dispatch (the f16 pre-passes, "
               f"the output copy); error against PyTorch's float32 result on the same inputs.{same_run}", "",
               table(["op", "variant", "form", "attention ms", "all kernels ms", "err"], rows), ""]
    if not md:
        return []
    return ["## Flash attention: variants and what each part costs", "", *md]


def quant_accuracy_section():
    """BENCHMARKS.md's quantization section, from results/quant_accuracy.json
    (scripts/eval_llm.py); empty where that file is missing."""
    r = load("quant_accuracy")
    if not r:
        return []
    tf, size = r["teacher_forced"], r["size_bytes"]
    quant = [k for k in size if k != "bf16"]
    commands = r.get("compile", {})
    rows = []
    for name in quant:
        pair = f"etmetal {name} vs etmetal bf16"
        rows.append([name, f"{100 * tf['agreement'][pair]:.2f}%", f(tf["kl"][pair], 4),
                     f"{100 * tf['agreement'].get(f'etmetal {name} vs eager f32', float('nan')):.2f}%",
                     f(tf["perplexity"][f"etmetal {name}"], 3), mib(size[name]), f"{r['size_ratio'][name]:.3f}",
                     f(r.get("decode", {}).get(name, {}).get("decode_tokens_per_s"), 2),
                     f(commands.get(name, {}).get("seconds"), 0)])
    md = ["## Quantization on real weights: accuracy, size, decode speed", "",
          f"`scripts/eval_llm.py` on {r['model']}: one bfloat16 export (transformers' ExecuTorch recipe, "
          "`scripts/export_llm.py --dtype bfloat16`) compiled once in bf16 and once per recipe (the flags below; "
          f"the calibrated ones on `{r.get('calibration_text', '')}`, the scored text being another chapter). "
          f"Text: `{r['text']}` ({tf['tokens']} next-token predictions), teacher-forced through each `.pte`'s "
          "`prefill` chunk by chunk with the KV cache, and through eager transformers in one call. "
          f"Machine: {r['machine']['cores']} cores of {r['machine']['cpu']} (shared: other builds ran "
          f"meanwhile, so rates and compile times are rough), etmetal on `--device {r['machine']['device']}`; "
          f"decode tokens/s summed over the greedy prompts. Command: `{r['command']}`.", "",
          table(["recipe", "agreement with etmetal bf16", "mean KL (nats)", "agreement with eager f32",
                 "perplexity", "MiB on disk", "size / bf16 file", "decode tokens/s", "compile s"], rows), "",
          "The references: " + "; ".join(
              f"{k}: {100 * v:.2f}% (KL {f(tf['kl'][k], 4)})" for k, v in tf["agreement"].items()
              if not any(k.startswith(f"etmetal {q} ") for q in quant)) + "; perplexity " + ", ".join(
              f"{k} {f(v, 3)}" for k, v in tf["perplexity"].items() if k.split(" ", 1)[1] not in quant) + ". "
          f"The bf16 file is {mib(size['bf16'])} MiB: it stores the tied embedding twice (the table and the head's "
          "copy), which the quantized files do not (the embedding gathers rows of the head's quantized table).", "",
          "Recipes (each `etmetal compile` of the export's `forward` and `prefill`):", ""]
    for name, c in commands.items():
        words = c["command"].split()
        flags = words[words.index("--quantize"):] if "--quantize" in words else []
        flags = [re.sub(r"^.*/(tests/parity/data/)", r"\1", re.sub(r"^.*/(export-[^/]+)/", r"$E/", w)) for w in flags]
        md.append(f"- {name}: `{' '.join(flags) or '(none)'}`")
    if r["greedy"]:
        md += ["", f"Greedy text ({len(r['greedy'])} prompts):", ""]
        for g in r["greedy"]:
            md += [f"- `{g['prompt']}`"] + [f"  - {k}: {json.dumps(v, ensure_ascii=False)}"
                                           for k, v in g.items() if k != "prompt"]
    return md + [""]


def whisper_rtf_section():
    """BENCHMARKS.md's speech-to-text section, from results/whisper_rtf.json
    (benchmarks/whisper_rtf.py); empty where that file is missing."""
    r = load("whisper_rtf")
    if not r:
        return []
    rows = [[row["machine"], f"`--device {row['device']}` (`--backend {row['backend']}`)", f(row["audio_s"], 1),
             f(row["seconds"], 2), f(row["rtf"], 3), f(row["encoder_ms_per_window"], 1),
             f(row["ms_per_token"], 2)] for row in r["rows"]]
    return ["## Speech to text: `etmetal transcribe` real-time factor", "",
            f"`benchmarks/whisper_rtf.py`: {r['model']}, exported by `scripts/export_whisper.py` and compiled "
            f"for the GPU and the CPU; `etmetal transcribe --language en` of {r['audio_s']:.0f} s of synthetic "
            f"audio in 30-second windows, each decoding to `max_length` {r['max_length']} (random weights never "
            "end a window; about what 30 s of speech gives), the second of two runs (the first builds the GPU "
            "pipelines). Real-time factor: processing time (features, encoder, decoder; the load not counted) "
            "over audio time, below 1 faster than real time. What the seconds hold beyond the encoder and the "
            "decoder is the log-mel features (on one core) and, at each window, the caches moving between the "
            "two methods (read back from `text_decoder`'s delegate, uploaded to `encoder`'s, and back).", "",
            table(["machine", "device", "audio s", "seconds", "real-time factor", "encoder ms / window",
                   "decoder ms / token"], rows), ""]


def main():
    gpu, cpu = load("gpu"), load("cpu")
    md = ["# etmetal benchmarks", "",
          "Written by `python3 benchmarks/run.py report` from `benchmarks/results/*.json`; do not edit by hand. "
          "How each figure is taken: `benchmarks/README.md`. Ratios are etmetal time over the other's (below 1: "
          "etmetal is faster).", ""]
    op_ratios = model_ratios = []
    if gpu:
        mach = gpu["machine"]
        md += ["## GPU: etmetal (wgpu over Vulkan) vs PyTorch eager CUDA", "",
               f"Cards: {', '.join(sorted({r.get('card', mach['gpu']) for r in rows_of(gpu)}))}, each row "
               "naming its own in the run column (ratios are within one row, one card, one run). "
               f"Last machine: {mach['gpu']} ({mach['sms']} SMs; nvidia-smi: {mach['nvidia_smi']}), "
               f"{mach['cores']} cores of {mach['cpu']}; PyTorch {mach['torch']} (CUDA {mach['cuda']}). "
               f"etmetal adapters: {', '.join(sorted({o['adapter'] for o in gpu['ops'] if 'adapter' in o})) or '–'}. "
               f"{gpu['runs']} timed runs after {gpu['warmup']} warm-ups (PyTorch: 5x the runs). "
               f"{repeats(gpu)} etmetal "
               "runs with `--coop auto`: f16/bf16 matrix products on the tensor-core alternatives where the "
               "GPU offers them and they measure faster (kernels named `…_coop`, `…_range` the scaling "
               "pre-pass; the default since 2026-12-07, see the README).", ""]
        rows, op_ratios = op_rows(gpu)
        md += ["### Ops", "",
               f"PyTorch: {torch_timing(gpu)}, operands on the GPU, TF32 off. etmetal kernel: sum of "
               "the GPU timestamps of every dispatch (each in its own compute pass, so no launch gaps), median "
               "over the profiled runs. etmetal end to end: one "
               "`Method::execute` (host inputs up, dispatches, outputs read back), which PyTorch's column "
               "does not include. Peak: the datasheet's 67 TFLOP/s f32 and 990 TFLOP/s dense bf16 (both "
               "cards), and HBM 4.8 TB/s on the H200, 3.35 TB/s on the H100 (memory-bound rows: GB/s and % "
               "of the row's card's). " + (INT4 if any(o["dtype"] == "int4" for o in gpu["ops"])
                                                             else "") +
               "err: ‖etmetal − ref‖/‖ref‖, ref in f64 (f32 rows) or f32 (bf16 rows) from the same inputs. "
               f"bmm runs {4} batches.", "",
               table(["op", "dtype", "run", "PyTorch ms", "etmetal kernel ms", "ratio", "rate etmetal / PyTorch",
                      "etmetal % of peak", "etmetal e2e ms", "dispatches", "err"], rows), ""]
        rows, model_ratios = model_rows(gpu)
        md += ["### Models (batch 1)", "",
               "The real-models zoo of `tests/parity/models/` at full size (ResNet-18 and MobileNetV2 at "
               "224x224, BERT-base at 128 tokens, the Whisper-tiny encoder over 80x3000 mel frames, the "
               "KV-cache decoders of `benchmarks/run.py`: a prefill of 128 tokens and one decode step). Each is "
               "exported on the GPU machine (`torch.export` + `run_decompositions({})`) and compiled there "
               f"with `etmetal compile --max-buffer 2G`. PyTorch GPU: {torch_timing(gpu)}, inputs already on the GPU; "
               "torch.compile: default mode, the same timing after its compiling first call; PyTorch e2e: "
               "host inputs to the GPU, forward, outputs back to the host (wall clock), the same work an "
               "etmetal execute does; torch.compile e2e: the same for the compiled module (– in rows measured before "
               "it was added). ratio e2e = etmetal e2e / PyTorch eager e2e; ratio compiled = etmetal "
               "kernel / torch.compile GPU. " + (LLAMA if any(m["model"].startswith("llama1b") for m in gpu["models"])
                                                else "") +
               (QWEN3_MOE if any(m["model"].startswith("qwen3moe") for m in gpu["models"]) else "") +
               "placed: partitions / kernels / nodes left on the CPU. err "
               "against PyTorch eager's output on the GPU.", "",
               table(["model", "dtype", "run", "weights MiB", "PyTorch GPU ms", "torch.compile GPU ms", "PyTorch e2e ms",
                      "torch.compile e2e ms", "etmetal kernel ms", "etmetal e2e ms", "ratio e2e", "ratio compiled", "roofline",
                      "placed", "dispatches", "top kernel", "err"], rows), ""]
        comp = [[m["model"], m["dtype"], f(m.get("compile_s")), f(m.get("torch_compile_first_s"))]
                for m in gpu["models"] if "error" not in m]
        md += ["Compile on the GPU machine, seconds: `etmetal compile` of the exported program vs "
               "torch.compile's first call.", "",
               table(["model", "dtype", "etmetal compile s", "torch.compile first call s"], comp), ""]
        md += dynamic_section(gpu)
        gaps = sorted(op_ratios + model_ratios, key=lambda x: -x[1])[:3]
        md += ["### Largest gaps to PyTorch", ""] + [f"- {n}: {r:.1f}x PyTorch's time" for n, r in gaps] + [""]
        mem = [[m["model"], m["dtype"], mib(m["weight_bytes"]), mib(m["peak_rss_after_load"]), mib(m["peak_rss"])]
               for m in gpu["models"] if "error" not in m]
        md += ["### Host memory of the GPU runs", "",
               "Peak RSS (VmHWM) of the `etmetal run` process after load and at the end, MiB.", "",
               table(["model", "dtype", "weights", "peak RSS after load", "peak RSS"], mem), ""]
    else:
        md += ["## GPU", "", "Not run: no `results/gpu.json`.", ""]
    if cpu:
        mach = cpu["machine"]
        md += ["## CPU: etmetal's CPU path vs ExecuTorch's runtime", "",
               f"Machine: {mach['cores']} cores of {mach['cpu']}; PyTorch {mach['torch']} with the pip "
               f"`executorch` runtime. {cpu['threads']} threads for both (RAYON_NUM_THREADS; XNNPACK's pool "
               f"defaults to the cores). etmetal: `compile --backend cpu` + `run --device cpu --bench`; "
               f"ExecuTorch: `executorch.runtime` `Method.execute` from Python, wall clock. Median of "
               f"the row's runs ({cpu['runs']} after {cpu['warmup']} warm-ups, fewer where those would take "
               f"over 20 s). The real-models zoo at full size, f32, batch 1. The machine is a shared "
               f"2-core development box (other builds may run meanwhile): treat these as rough.", ""]
        rows = []
        for m in cpu["models"]:
            def et(kind):
                return fs(m, f"et_{kind}_ms") if f"et_{kind}_ms" in m else \
                    "error: " + m.get(f"et_{kind}_error", "?")[:80]
            rows.append([m["model"], m.get("runs", cpu["runs"]), fs(m, "etmetal_ms"), et("portable"), et("xnnpack"),
                         f(ratio(m["etmetal_ms"], m.get("et_portable_ms")), 2),
                         f(ratio(m["etmetal_ms"], m.get("et_xnnpack_ms")), 2), f(m["etmetal_err"], 1)])
        md += [table(["model", "runs", "etmetal ms", "ET portable ms", "ET XNNPACK ms", "vs portable", "vs XNNPACK",
                      "etmetal err"], rows), ""]
        rows = [[m["model"], fs(m, "compile_s_etmetal_cpu"), fs(m, "compile_s_et_xnnpack"),
                 f(ratio(m["compile_s_etmetal_cpu"], m.get("compile_s_et_xnnpack")), 2),
                 fs(m, "compile_s_et_portable"), f(ratio(m["compile_s_etmetal_cpu"], m.get("compile_s_et_portable")), 2),
                 fs(m, "compile_s_etmetal_metal")] for m in cpu["models"]]
        md += ["### Compile time", "",
               "Seconds from the same f32 `.pt2`, like with like: `etmetal compile --backend cpu` (a process, "
               "wall clock) beside ExecuTorch's `torch.export.load` + `to_edge_transform_and_lower(..., "
               "XnnpackPartitioner)` + `to_executorch()`, and beside `to_edge(...)` + `to_executorch()` (portable "
               "kernels; in one Python process, torch already imported). `etmetal compile --backend metal` "
               "compares with torch.compile in the GPU section; its time here is for reference. "
               f"{repeats(cpu)}", "",
               table(["model", "etmetal cpu s", "ET XNNPACK s", "etmetal cpu / XNNPACK", "ET portable s",
                      "etmetal cpu / portable", "etmetal metal s"], rows), ""]
        rows = [[m["model"], mib(m["weight_bytes"]), mib(m["peak_rss_after_load"]), mib(m["peak_rss"]),
                 f(ratio(m["peak_rss"], m["weight_bytes"]), 1)] for m in cpu["models"]]
        md += ["### Memory (CPU path)", "",
               "Peak RSS (VmHWM) of `etmetal run --device cpu`, MiB, against the model's weight bytes. "
               "The process's own baseline (binary, allocator) is a few MiB, so small models read high.", "",
               table(["model", "weights", "peak RSS after load", "peak RSS", "peak / weights"], rows), ""]
    else:
        md += ["## CPU", "", "Not run: no `results/cpu.json`.", ""]
    md += host_path_section()
    md += binaries_section()
    md += first_load_section()
    md += flash_variants_section()
    md += quant_accuracy_section()
    md += whisper_rtf_section()
    if gpu and chart(op_ratios, model_ratios):
        md += ["## Chart", "", "![etmetal / PyTorch time ratios](benchmarks/ratios.png)", ""]
    elif PNG.exists():
        md += ["## Chart", "", "![etmetal / PyTorch time ratios](benchmarks/ratios.png) (from the last run "
               "that had matplotlib)", ""]
    else:
        md += ["## Chart", "", "No chart: matplotlib did not import where the report ran.", ""]
    md += ["## Reproduce", "", "```",
           "export CARGO_TARGET_DIR=target && cargo build --release -p etmetal",
           "mkdir -p .bench && cp target/release/etmetal .bench/ && strip .bench/etmetal",
           "python benchmarks/run.py prepare   # torch 2.15 + executorch venv (scripts/setup-python.sh)",
           "python benchmarks/run.py cpu",
           "# on the GPU machine, with .bench/ and the Vulkan loader there:",
           "python3 benchmarks/run.py gpu && python3 benchmarks/run.py report",
           "```", ""]
    (REPO / "BENCHMARKS.md").write_text("\n".join(md))
    print(f"wrote {REPO / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
