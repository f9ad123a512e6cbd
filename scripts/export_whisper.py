"""Export a transformers Whisper model for `etmetal transcribe`: one
program with an `encoder` method and a `text_decoder` method whose caches
live in mutable buffers, so a window's cross-attention keys and values are
computed once (by `encoder`) and stay on the GPU while `text_decoder`
decodes.

Each decoder layer has two buffers, `kv_cache_k_{i}` and `kv_cache_v_{i}`,
of shape [1, heads, L + S, head_dim]: rows 0..L are the self-attention
cache (L = --max-target-len decoder positions), rows L..L+S the
cross-attention keys/values of the S encoder frames. Both methods write
their rows with `index_copy_`, so both keep the buffers as state, and with
`etmetal compile --backend metal` each method's one GPU partition keeps
them resident (a method that only read them would upload them at every
step):

- `encoder(input_features f32 [1, n_mels, frames]) -> hidden [1, S, d]`:
  the encoder, then each layer's cross-attention k/v projections written
  into rows L..L+S;
- `text_decoder(tokens int64 [1, 1], positions int64 [1]) -> logits
  [1, 1, vocab]`: one decoder step (the same signature as `etmetal
  generate`'s decoders), writing its self-attention k/v at `positions` and
  attending to rows 0..L (causal by position) and L..L+S.

The layers are transformers' own modules (their weights, layer norms,
projections and GELU); only the attention's cache handling is written here,
in the order transformers computes it (q scaled before the product).

Writes into OUT: `encoder.pt2`, `text_decoder.pt2` and the files
`transcribe` reads beside the program (tokenizer.json,
tokenizer_config.json, generation_config.json with `max_length` = L,
preprocessor_config.json). Then:

    etmetal compile --method encoder=OUT/encoder.pt2 \\
        --method text_decoder=OUT/text_decoder.pt2 -o OUT/whisper.pte
    etmetal transcribe OUT/whisper.pte audio.wav

Usage (the project venv has torch and transformers):
    python scripts/export_whisper.py MODEL_DIR -o OUT [--max-target-len 448]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F


def load(model_dir: str | Path):
    """The model and its processor (feature extractor and tokenizer), as
    `from_pretrained` gives them, in float32."""
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), processor


def cache_buffers(model, max_target_len: int) -> dict[str, torch.Tensor]:
    """The zero-initialised caches both methods name (same names, shapes and
    initial values: one state in the program)."""
    cfg = model.config
    heads = cfg.decoder_attention_heads
    head_dim = cfg.d_model // heads
    frames = cfg.max_source_positions
    shape = (1, heads, max_target_len + frames, head_dim)
    out = {}
    for i in range(cfg.decoder_layers):
        out[f"kv_cache_k_{i}"] = torch.zeros(shape)
        out[f"kv_cache_v_{i}"] = torch.zeros(shape)
    return out


class _WithCaches(torch.nn.Module):
    def __init__(self, model, max_target_len: int):
        super().__init__()
        self.whisper = model.model
        self.proj_out = model.proj_out
        self.max_target_len = max_target_len
        self.heads = model.config.decoder_attention_heads
        for name, t in cache_buffers(model, max_target_len).items():
            self.register_buffer(name, t, persistent=False)

    def caches(self, i: int):
        return getattr(self, f"kv_cache_k_{i}"), getattr(self, f"kv_cache_v_{i}")

    def split_heads(self, x):
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)


class EncoderMethod(_WithCaches):
    """`encoder`: hidden states of a window, and every layer's
    cross-attention keys and values written into the caches' rows L..L+S."""

    def forward(self, input_features):
        hidden = self.whisper.encoder(input_features).last_hidden_state
        frames = hidden.shape[1]
        rows = torch.arange(self.max_target_len, self.max_target_len + frames)
        for i, layer in enumerate(self.whisper.decoder.layers):
            k, v = self.caches(i)
            attn = layer.encoder_attn
            k.index_copy_(2, rows, self.split_heads(attn.k_proj(hidden)))
            v.index_copy_(2, rows, self.split_heads(attn.v_proj(hidden)))
        return hidden


class DecoderMethod(_WithCaches):
    """`text_decoder`: one decoder step at `positions` over the caches."""

    def attend(self, attn, x, k, v, mask):
        b, t, d = x.shape
        q = self.split_heads(attn.q_proj(x) * attn.scaling)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return attn.out_proj(o.transpose(1, 2).reshape(b, t, d))

    def forward(self, tokens, positions):
        dec = self.whisper.decoder
        n = self.max_target_len
        h = dec.embed_tokens(tokens) + dec.embed_positions.weight[positions].unsqueeze(0)
        causal = torch.arange(n).unsqueeze(0) <= positions.unsqueeze(1)
        for i, layer in enumerate(dec.layers):
            k, v = self.caches(i)
            x = layer.self_attn_layer_norm(h)
            k.index_copy_(2, positions, self.split_heads(layer.self_attn.k_proj(x)))
            v.index_copy_(2, positions, self.split_heads(layer.self_attn.v_proj(x)))
            h = h + self.attend(layer.self_attn, x, k[:, :, :n], v[:, :, :n], causal)
            x = layer.encoder_attn_layer_norm(h)
            h = h + self.attend(layer.encoder_attn, x, k[:, :, n:], v[:, :, n:], None)
            x = layer.final_layer_norm(h)
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        return self.proj_out(dec.layer_norm(h))


def frames_of(model) -> int:
    """Mel frames of one window (the encoder's two convolutions halve them
    once: 3000 for 30 s)."""
    enc = model.model.encoder
    return model.config.max_source_positions * enc.conv1.stride[0] * enc.conv2.stride[0]


def export(model, processor, out: Path, max_target_len: int | None = None) -> tuple[Path, Path]:
    """Write OUT/encoder.pt2, OUT/text_decoder.pt2 and the files beside them."""
    cfg = model.config
    n = min(max_target_len or cfg.max_target_positions, cfg.max_target_positions)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        features = torch.zeros(1, cfg.num_mel_bins, frames_of(model))
        encoder = torch.export.export(EncoderMethod(model, n).eval(), (features,))
        step = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        decoder = torch.export.export(DecoderMethod(model, n).eval(), step)
    files = out / "encoder.pt2", out / "text_decoder.pt2"
    torch.export.save(encoder, files[0])
    torch.export.save(decoder, files[1])
    processor.save_pretrained(out)
    config = model.generation_config
    config.max_length = n
    config.save_pretrained(out)
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a transformers Whisper directory (or hub id where reachable)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--max-target-len", type=int, default=None,
                    help="decoder positions the self-attention cache holds (default: the model's, 448)")
    args = ap.parse_args()
    model, processor = load(args.model)
    files = export(model, processor, args.out, args.max_target_len)
    print(f"wrote {files[0]} and {files[1]}; then:\n"
          f"  etmetal compile --method encoder={files[0]} --method text_decoder={files[1]} "
          f"-o {args.out / 'whisper.pte'}\n"
          f"  etmetal transcribe {args.out / 'whisper.pte'} AUDIO.wav")


if __name__ == "__main__":
    main()
