"""Audio and a Whisper tokenizer for the speech tests and the transcribe
benchmark (no pytest here: benchmarks/whisper_rtf.py imports it on the GPU
machine)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

RATE = 16000


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, channels: int = 1):
    """16-bit PCM, as most WAV files are; `samples` in [-1, 1], frames × channels."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def wav_samples(path: Path) -> np.ndarray:
    """The WAV's samples as soundfile reads 16-bit PCM (÷ 32768)."""
    with wave.open(str(path), "rb") as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def speechlike(seconds: float, seed: int) -> np.ndarray:
    """Tones gliding under an envelope, with noise: something the features and
    a random model react to."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f = 200 + 150 * np.sin(2 * np.pi * 0.7 * t)
    x = 0.4 * np.sin(2 * np.pi * np.cumsum(f) / RATE) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    x += 0.2 * np.sin(2 * np.pi * 1300 * t) * (t % 1.0 < 0.5)
    return (x + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def tiny_tokenizer():
    """A byte-level BPE tokenizer with Whisper's special tokens in Whisper's order."""
    from transformers import WhisperTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(range(256))}
    merges = []
    for pair in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("Ġ", "s")]:
        merges.append(pair)
        vocab["".join(pair)] = len(vocab)
    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    specials = (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                   "<|notimestamps|>"])
    tok.add_tokens(specials, special_tokens=True)
    tok.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    return tok
