"""Real-time factor of `etmetal transcribe` on a Whisper-base-sized model.

Builds a Whisper with whisper-base's shapes (d_model 512, 6 encoder and 6
decoder layers, 8 heads, FFN 2048, 80 mel bins, 30-second windows of 3000
frames, 448 decoder positions, vocabulary 51866) and random weights, with
the synthetic byte-level tokenizer of tests/parity/speech.py
padded to that vocabulary; exports it with scripts/export_whisper.py,
compiles it for the GPU (`--backend metal`) and the CPU (`--backend cpu`),
and transcribes SECONDS of synthetic audio with each. Random weights never
end a window by themselves, so each window decodes up to `max_length`
(TOKENS, about what 30 s of speech gives): the figures are for that many
tokens a window.

Each row is merged into --out (default benchmarks/results/whisper_rtf.json,
keyed by machine and device), which `benchmarks/run.py report` writes into
BENCHMARKS.md.

Usage (torch and transformers; the etmetal binary):
    python benchmarks/whisper_rtf.py --bin target/release/etmetal --work /tmp/w [--seconds 60]
        [--tokens 128] [--devices auto,cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for extra in [HERE.parent / "scripts", HERE.parent / "tests" / "parity", HERE]:
    sys.path.insert(0, str(extra))


def base_model(out: Path, vocab: int = 51866):
    from transformers import (WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration,
                              WhisperProcessor)
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    import speech as tt

    tok = tt.tiny_tokenizer()
    # pad the vocabulary with plain tokens before the special ones' count
    fill = vocab - len(tok)
    tok.add_tokens([f"<|fill{i}|>" for i in range(fill)])
    ids = tok.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    cfg = WhisperConfig(vocab_size=len(tok), num_mel_bins=80, d_model=512, encoder_layers=6, decoder_layers=6,
                        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                        decoder_ffn_dim=2048, max_source_positions=1500, max_target_positions=448,
                        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
                        decoder_start_token_id=ids("<|startoftranscript|>"))
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).eval()
    g = model.generation_config
    g.decoder_start_token_id = ids("<|startoftranscript|>")
    g.lang_to_id = {f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES}
    g.task_to_id = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
    g.no_timestamps_token_id = ids("<|notimestamps|>")
    g.is_multilingual = True
    g.suppress_tokens = list(range(128, 256))
    g.begin_suppress_tokens = [eot]
    g.eos_token_id = g.pad_token_id = g.bos_token_id = eot
    g._from_model_config = False
    processor = WhisperProcessor(WhisperFeatureExtractor(feature_size=80, chunk_length=30), tok)
    return model, processor


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tokens", type=int, default=128, help="max_length: decoder positions a window uses")
    ap.add_argument("--devices", default="auto,cpu")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "whisper_rtf.json")
    args = ap.parse_args()
    import export_whisper
    import speech as tt

    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, processor = base_model(args.work)
    export = args.work / "export"
    export_whisper.export(model, processor, export, 448)
    config = json.loads((export / "generation_config.json").read_text())
    config["max_length"] = args.tokens
    (export / "generation_config.json").write_text(json.dumps(config))
    print(f"exported in {time.time() - t0:.1f} s", flush=True)
    wav = args.work / "speech.wav"
    tt.write_wav(wav, tt.speechlike(args.seconds, 0))
    rows = []
    for device in args.devices.split(","):
        backend = "cpu" if device == "cpu" else "metal"
        pte = export / f"whisper-{backend}.pte"
        if not pte.is_file():
            t = time.time()
            subprocess.run([str(args.bin), "compile", "--method", f"encoder={export / 'encoder.pt2'}",
                            "--method", f"text_decoder={export / 'text_decoder.pt2'}", "-o", str(pte),
                            "--backend", backend], check=True)
            print(f"compiled {backend} in {time.time() - t:.1f} s", flush=True)
        for run in range(2):  # the first run builds the GPU pipelines
            p = subprocess.run([str(args.bin), "transcribe", str(pte), str(wav), "--language", "en",
                                "--device", device], capture_output=True, text=True)
            print(p.stderr.strip(), flush=True)
            if p.returncode != 0:
                raise SystemExit(p.returncode)
        line = p.stderr.strip().splitlines()[-1]
        m = re.search(r"in ([\d.]+) s: real-time factor ([\d.]+) \((\d+) windows?; encoder ([\d.]+) s, "
                      r"decoder (\d+) tokens in ([\d.]+) s", line)
        seconds, rtf, windows, enc, tokens, dec = m.groups()
        rows.append(dict(device=device, backend=backend, audio_s=args.seconds, seconds=float(seconds),
                         rtf=float(rtf), windows=int(windows), encoder_s=float(enc), tokens=int(tokens),
                         decoder_s=float(dec), ms_per_token=1e3 * float(dec) / max(1, int(tokens)),
                         encoder_ms_per_window=1e3 * float(enc) / max(1, int(windows))))
    machine = machine_info()
    for row in rows:
        row["machine"] = machine["gpu"] if row["device"] != "cpu" else machine["cpu"]
    old = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": []}
    keep = [r for r in old["rows"] if (r["machine"], r["device"]) not in {(n["machine"], n["device"]) for n in rows}]
    result = {"model": "a Whisper of whisper-base's shapes (74M parameters) with random weights",
              "audio_s": args.seconds, "max_length": args.tokens, "rows": keep + rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


def machine_info() -> dict:
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    cores = os.cpu_count()
    return {"cpu": f"{cores} cores of {cpu}", "gpu": f"{gpu or 'GPU'} (Vulkan)"}


if __name__ == "__main__":
    main()
