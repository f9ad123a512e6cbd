"""`etmetal transcribe` against transformers, on models made here with
random weights and saved as transformers saves them:

- a tiny Whisper (2+2 layers, d=64, 80 mel bins, 3-second windows: the
  encoder takes 300 frames), with a byte-level tokenizer holding Whisper's
  special tokens (start, 100 languages, tasks, no-timestamps, 1501
  timestamps) and a generation config as released checkpoints have it
  (lang_to_id, task_to_id, suppress_tokens, begin_suppress_tokens...);
  exported by scripts/export_whisper.py as a user runs it and compiled for
  the GPU (`--backend metal`, run on this machine's adapter):
  - the log-mel features etmetal computes match `WhisperFeatureExtractor`'s
    within 1e-4 (full, short and loud windows, 80 and 128 bins);
  - each window's token ids are exactly those of transformers'
    `generate()` on the same window's features: with a language given,
    detected, translating, and with timestamps; over a file of three
    windows;
- a tiny wav2vec2 CTC model (`Wav2Vec2ForCTC`, a character vocab.json):
  the text equals `processor.batch_decode` of eager's argmax;
- bad input: not a WAV, a model without the methods transcribe needs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from speech import RATE, speechlike, tiny_tokenizer, wav_samples, write_wav

REPO = Path(__file__).resolve().parents[2]
EXPORT = REPO / "scripts" / "export_whisper.py"
CHUNK_S = 3  # the tiny model's window
FRAMES = CHUNK_S * RATE // 160
MAX_TARGET = 48
TIMEOUT = 900


def tiny_whisper(out: Path, n_mels: int = 80):
    """A random Whisper saved with its processor and generation config into `out`."""
    from transformers import (WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration,
                              WhisperProcessor)
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tok = tiny_tokenizer()
    ids = tok.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    cfg = WhisperConfig(vocab_size=len(tok), num_mel_bins=n_mels, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_source_positions=FRAMES // 2, max_target_positions=MAX_TARGET,
                        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
                        decoder_start_token_id=ids("<|startoftranscript|>"), init_std=0.3)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).eval()
    g = model.generation_config
    g.decoder_start_token_id = ids("<|startoftranscript|>")
    g.lang_to_id = {f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES}
    g.task_to_id = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
    g.no_timestamps_token_id = ids("<|notimestamps|>")
    g.is_multilingual = True
    # bytes 128..255 too, so the random model's text is whole UTF-8 (the
    # ids are the bytes' values)
    g.suppress_tokens = [1, 2, 7, 8, 9, 11, 33, 90] + list(range(128, 256))
    g.begin_suppress_tokens = [ids("Ġ"), eot]
    g.max_initial_timestamp_index = 50
    g.eos_token_id = g.pad_token_id = g.bos_token_id = eot
    g.max_length = MAX_TARGET
    g._from_model_config = False  # else from_pretrained rebuilds it from config.json
    processor = WhisperProcessor(WhisperFeatureExtractor(feature_size=n_mels, chunk_length=CHUNK_S), tok)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model, processor


@pytest.fixture(scope="module")
def whisper(etmetal, tmp_path_factory):
    """The tiny Whisper saved, exported by scripts/export_whisper.py, compiled
    for the GPU; (model, processor, .pte)."""
    root = tmp_path_factory.mktemp("whisper")
    model, processor = tiny_whisper(root / "model")
    out = root / "export"
    p = subprocess.run([sys.executable, str(EXPORT), str(root / "model"), "-o", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    pte = out / "whisper.pte"
    p = subprocess.run([str(etmetal.binary), "compile", "--method", f"encoder={out / 'encoder.pt2'}",
                        "--method", f"text_decoder={out / 'text_decoder.pt2'}", "-o", str(pte)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    # both methods keep the caches on the GPU: the cross-attention rows
    # written once a window by `encoder` are never uploaded by a step
    assert "state kept on the GPU" in p.stdout + p.stderr, p.stdout + p.stderr
    return model, processor, pte


def transcribe(etmetal, pte: Path, wav: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(etmetal.binary), "transcribe", str(pte), str(wav), *args],
                       capture_output=True, text=True, timeout=TIMEOUT)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def generate_ids(model, processor, audio: np.ndarray, **kwargs) -> list[int]:
    features = processor.feature_extractor(audio, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        out = model.generate(features, return_dict_in_generate=True, **kwargs)
    if "segments" in out:
        # with timestamps, `sequences` is re-assembled from the segments;
        # the decoder's own output is each segment's `result`
        return out["segments"][0][0]["result"]["sequences"].tolist()
    return out["sequences"][0].tolist()


def test_features_match_whisper_feature_extractor(etmetal, whisper, tmp_path):
    model, processor, pte = whisper
    cases = {
        "full": speechlike(CHUNK_S, 1),
        "short": speechlike(1.3, 2),  # padded with zeros to the window
        "loud": np.clip(speechlike(CHUNK_S, 3) * 2.4, -1, 1),
    }
    for name, audio in cases.items():
        wav = tmp_path / f"{name}.wav"
        write_wav(wav, audio)
        dump = tmp_path / name
        transcribe(etmetal, pte, wav, "--language", "en", "--dump-features", str(dump), "--ids")
        got = np.load(dump / "window0.npy")
        want = processor.feature_extractor(wav_samples(wav), sampling_rate=RATE, return_tensors="np").input_features
        assert got.shape == want.shape == (1, 80, FRAMES)
        err = np.abs(got - want).max()
        print(f"{name}: max |etmetal - transformers| = {err:.3g}")
        assert err <= 1e-4, f"{name}: features differ by {err:.3g}"


def test_features_128_bins(etmetal, tmp_path):
    """large-v3's 128 bins, through a CPU-compiled tiny model of 128 mels."""
    model, processor = tiny_whisper(tmp_path / "model", n_mels=128)
    out = tmp_path / "export"
    subprocess.run([sys.executable, str(EXPORT), str(tmp_path / "model"), "-o", str(out)], check=True,
                   capture_output=True, timeout=TIMEOUT)
    pte = out / "whisper128.pte"
    subprocess.run([str(etmetal.binary), "compile", "--method", f"encoder={out / 'encoder.pt2'}",
                    "--method", f"text_decoder={out / 'text_decoder.pt2'}", "-o", str(pte), "--backend", "cpu"],
                   check=True, capture_output=True, timeout=TIMEOUT)
    wav = tmp_path / "a.wav"
    write_wav(wav, speechlike(2.2, 4))
    transcribe(etmetal, pte, wav, "--language", "en", "--dump-features", str(tmp_path / "f"), "--ids")
    got = np.load(tmp_path / "f" / "window0.npy")
    want = processor.feature_extractor(wav_samples(wav), sampling_rate=RATE, return_tensors="np").input_features
    assert got.shape == want.shape == (1, 128, FRAMES)
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("mode", ["english", "detect", "translate", "timestamps"])
def test_token_ids_match_generate(etmetal, whisper, tmp_path, mode):
    model, processor, pte = whisper
    audio = speechlike(CHUNK_S, 5)
    wav = tmp_path / "a.wav"
    write_wav(wav, audio)
    args, kwargs = {
        "english": (["--language", "en"], dict(language="en", task="transcribe")),
        # the task is always given (transcribe by default), as openai-whisper does
        "detect": ([], dict(task="transcribe")),
        "translate": (["--language", "fr", "--task", "translate"], dict(language="fr", task="translate")),
        "timestamps": (["--language", "en", "--timestamps"], dict(language="en", return_timestamps=True)),
    }[mode]
    want = generate_ids(model, processor, wav_samples(wav), **kwargs)
    got = [int(t) for t in transcribe(etmetal, pte, wav, *args, "--ids").stdout.split()]
    print(f"{mode}: {len(want)} tokens")
    assert got == want


def test_long_file_goes_in_windows_and_streams_text(etmetal, whisper, tmp_path):
    model, processor, pte = whisper
    audio = speechlike(2 * CHUNK_S + 1.5, 6)
    wav = tmp_path / "long.wav"
    write_wav(wav, audio)
    samples = wav_samples(wav)
    chunks = [samples[k:k + CHUNK_S * RATE] for k in range(0, samples.size, CHUNK_S * RATE)]
    want = [generate_ids(model, processor, c, language="en", task="transcribe") for c in chunks]
    p = transcribe(etmetal, pte, wav, "--language", "en", "--ids")
    got = [[int(t) for t in line.split()] for line in p.stdout.splitlines()]
    assert got == want
    # the text: each window's decode, joined
    p = transcribe(etmetal, pte, wav, "--language", "en")
    texts = [processor.tokenizer.decode(ids, skip_special_tokens=True) for ids in want]
    assert p.stdout == "".join(texts).lstrip() + "\n"
    assert "real-time factor" in p.stderr and "3 windows" in p.stderr, p.stderr


def tiny_ctc(out: Path):
    """A random wav2vec2 CTC model and its processor, saved into `out`."""
    import json

    from transformers import (Wav2Vec2Config, Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC,
                              Wav2Vec2Processor)

    out.mkdir(parents=True, exist_ok=True)
    chars = ["<pad>", "<s>", "</s>", "<unk>", "|"] + list("ETAOINSHRDLUCMWFGYPBVK'")
    (out / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(chars)}))
    tok = Wav2Vec2CTCTokenizer(str(out / "vocab.json"), word_delimiter_token="|")
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=RATE, padding_value=0.0, do_normalize=True)
    processor = Wav2Vec2Processor(feature_extractor=fe, tokenizer=tok)
    cfg = Wav2Vec2Config(vocab_size=len(chars), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, conv_dim=(32, 32, 32), conv_stride=(5, 4, 4), conv_kernel=(10, 8, 4),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, pad_token_id=0,
                         initializer_range=0.5)
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(cfg).eval()
    processor.save_pretrained(out)
    model.config.save_pretrained(out)
    return model, processor


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_values):
        return self.model(input_values).logits


def test_ctc_text_matches_processor_decode(etmetal, tmp_path):
    model, processor = tiny_ctc(tmp_path / "ctc")
    seconds = 2
    with torch.no_grad():
        ep = torch.export.export(Logits(model), (torch.zeros(1, seconds * RATE),))
    torch.export.save(ep, tmp_path / "ctc" / "ctc.pt2")
    pte = tmp_path / "ctc" / "ctc.pte"
    subprocess.run([str(etmetal.binary), "compile", str(tmp_path / "ctc" / "ctc.pt2"), "-o", str(pte)],
                   check=True, capture_output=True, timeout=TIMEOUT)
    wav = tmp_path / "a.wav"
    write_wav(wav, speechlike(seconds, 7))
    inputs = processor(wav_samples(wav), sampling_rate=RATE, return_tensors="pt").input_values
    with torch.no_grad():
        ids = model(inputs).logits.argmax(-1)
    want = processor.batch_decode(ids)[0]
    p = transcribe(etmetal, pte, wav)
    print(f"transformers: {want!r}\netmetal:      {p.stdout!r}")
    assert want.strip(), "the random model should say something"
    assert p.stdout == want + "\n"


def test_bad_input_is_named(etmetal, whisper, tmp_path):
    _, _, pte = whisper
    not_wav = tmp_path / "notes.wav"
    not_wav.write_text("these are notes, not audio")
    p = transcribe(etmetal, pte, not_wav, ok=False)
    assert p.returncode == 2 and "not a WAV file" in p.stderr, p.stderr
    silent = tmp_path / "silent.wav"
    write_wav(silent, np.zeros(RATE, np.float32))
    p = transcribe(etmetal, pte, silent, ok=False)
    assert p.returncode == 2 and "silent" in p.stderr, p.stderr
    # a program with the encoder only
    export = pte.parent
    enc_only = tmp_path / "encoder-only.pte"
    subprocess.run([str(etmetal.binary), "compile", "--method", f"encoder={export / 'encoder.pt2'}",
                    "-o", str(enc_only), "--backend", "cpu"], check=True, capture_output=True, timeout=TIMEOUT)
    wav = tmp_path / "a.wav"
    write_wav(wav, speechlike(1, 8))
    p = transcribe(etmetal, enc_only, wav, ok=False)
    assert p.returncode == 2 and "no method `text_decoder`" in p.stderr, p.stderr
    assert "panicked" not in p.stderr
