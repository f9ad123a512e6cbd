"""The survey: models as users export them from torchvision, transformers
and timm (random weights, small configs), each built by one entry here.
`test_survey.py` runs them; `python tests/parity/survey.py --targets` prints
the ATen targets each export holds (no etmetal needed).

Every entry is exported as a user would: `torch.export.export(model.eval(),
args, strict=False)`. transformers models are wrapped to return their main
tensor (logits or the last hidden state) with `use_cache=False`, since the
default output is a ModelOutput holding a cache object.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# The models of the CI subset (`-m survey` runs only these, `ETMETAL_SURVEY=full` all).
FAST = {
    "tv_mobilenet_v3_small",
    "tv_squeezenet1_1",
    "hf_bert",
    "hf_mobilebert",  # pads after a middle dim on the GPU (a kernel bug once)
    "hf_llama",
    "hf_llama_position_ids",
    "hf_gemma3_text",
    "hf_gpt2",
    "hf_t5_encoder",  # position bias computed at compile time (etmetal-graph's fold_constants)
    "hf_wav2vec2",
    "timm_resnet18",
    "hf_mixtral",  # MoE routing: histc, grouped matmul (transformers.grouped_mm_fallback)
    "hf_beit",  # meshgrid for its relative position bias
    "hf_efficientnet",  # a ceil-mode pool whose kernel exceeds its input
    "tv_densenet169",  # cats of up to 33 parts, each written by kernels of 8 bindings
    "hf_qwen3_5",  # the chunked gated delta rule (forward substitution, eye, tensor_split)
    "hf_mamba2",  # Mamba-2's chunked SSD scan and the causal convolution
}


@dataclass(frozen=True)
class Entry:
    name: str
    make: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], tuple]
    # why nodes may stay on the cpu: words every cpu node's reason holds
    # (None: the GPU must take every node)
    cpu_reason: str | None = None

    @property
    def fast(self) -> bool:
        return self.name in FAST


def image(size: int, batch: int = 1):
    return lambda g: (torch.randn(batch, 3, size, size, generator=g),)


# ---- torchvision ----------------------------------------------------------

# The smallest input each needs, where 64x64 is too small.
TV_SIZE = {"inception_v3": 75, "maxvit_t": 224, "googlenet": 64}
# Constructor arguments that make the model take a small input.
TV_KWARGS = {
    "vit_b_16": {"image_size": 64},
    "vit_b_32": {"image_size": 64},
    "vit_l_16": {"image_size": 64},
    "vit_l_32": {"image_size": 64},
    "vit_h_14": {"image_size": 56},
    "inception_v3": {"aux_logits": False, "init_weights": False},
    "googlenet": {"aux_logits": False, "init_weights": False},
}
TV_SIZE.update({k: v["image_size"] for k, v in TV_KWARGS.items() if "image_size" in v})


# AlexNet's and VGG's first classifier weights (151 and 411 MB) and one 1x1
# convolution of RegNet-Y 128GF (219 MB) exceed the 128 MiB a GPU buffer
# binding may hold (wgpu's default limit, lavapipe's too)
BIG_WEIGHT = "byte buffer limit"

def torchvision_entries() -> list[Entry]:
    import torchvision.models as m

    out = []
    for name in m.list_models(module=m):
        kwargs = dict(num_classes=10, **TV_KWARGS.get(name, {}))

        def make(name=name, kwargs=kwargs):
            return m.get_model(name, weights=None, **kwargs)

        big = name in ("alexnet", "regnet_y_128gf") or name.startswith("vgg")
        out.append(Entry(f"tv_{name}", make, image(TV_SIZE.get(name, 64)), cpu_reason=BIG_WEIGHT if big else None))
    return out


# ---- transformers ---------------------------------------------------------


class MainOutput(torch.nn.Module):
    """Calls the model with its inputs by keyword (`keys`, in order) and
    returns its main tensor (logits, else last_hidden_state)."""

    def __init__(self, model: torch.nn.Module, keys: tuple):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *args):
        out = self.model(**dict(zip(self.keys, args)))
        if isinstance(out, torch.Tensor):
            return out
        for key in ("logits", "last_hidden_state"):
            if getattr(out, key, None) is not None:
                return getattr(out, key)
        return out[0]


SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
DECODER = dict(SMALL, num_key_value_heads=2, head_dim=8, use_cache=False, tie_word_embeddings=False)


def tokens(seq: int = 12, vocab: int = 128, mask: bool = True):
    """input_ids, and an attention mask with the last positions padded."""

    def f(g):
        ids = torch.randint(0, vocab, (1, seq), generator=g)
        if not mask:
            return (ids,)
        m = torch.ones(1, seq, dtype=torch.int64)
        m[:, -3:] = 0
        return ids, m

    return f


TEXT = ("input_ids", "attention_mask")
PIXELS = ("pixel_values",)


def hf(cls_name: str, config_name: str, keys: tuple = TEXT, encoder: bool = False, fan_in: bool = False, **config):
    """transformers' `cls_name` from a `config_name` of `config`; `encoder`:
    the encoder half of a seq2seq model (`model.get_encoder()`); `fan_in`:
    convolution and linear weights drawn with std 1/sqrt(fan in) and batch
    norm scales of 1, where the model's own init lets activations fade to
    nothing over its depth (a comparison would then hold for any output)."""

    def make():
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        model = getattr(transformers, cls_name)(cfg)
        if fan_in:
            for m in model.modules():
                if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                    torch.nn.init.kaiming_normal_(m.weight, nonlinearity="linear")
                elif isinstance(m, torch.nn.BatchNorm2d):
                    torch.nn.init.ones_(m.weight)
        return MainOutput(model.get_encoder() if encoder else model, keys)

    return make


# wav2vec2-style speech encoders: a tiny config and 0.1 s of 16 kHz audio
SPEECH = dict(
    keys=("input_values",),
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=(16, 16, 16),
    conv_stride=(5, 2, 2),
    conv_kernel=(10, 3, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)


def audio(g):
    return (torch.randn(1, 1600, generator=g),)


# linear-attention layers of the Qwen hybrids: 2 key heads, 4 value heads of 8
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MAMBA = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4)
# (name, model class, config class, config, why nodes stay on the cpu)
HYBRID = [
    ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(DECODER, **LINEAR), None),
    ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(DECODER, **LINEAR, **QWEN_MOE), None),
    ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", dict(DECODER, **LINEAR, **QWEN_MOE), None),
    ("mamba", "MambaForCausalLM", "MambaConfig", dict(MAMBA, time_step_rank=4, use_cache=False), None),
    ("mamba2", "Mamba2ForCausalLM", "Mamba2Config",
     dict(MAMBA, num_heads=8, head_dim=8, n_groups=1, chunk_size=8, use_cache=False), None),
    ("jamba", "JambaForCausalLM", "JambaConfig",
     dict(DECODER, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
          attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4), None),
    ("falcon_h1", "FalconH1ForCausalLM", "FalconH1Config",
     dict(DECODER, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
          mamba_expand=2, mamba_chunk_size=8), None),
]


def transformers_entries() -> list[Entry]:
    enc = dict(SMALL, type_vocab_size=2)
    e = [
        Entry("hf_bert", hf("BertModel", "BertConfig", **enc), tokens()),
        Entry("hf_roberta", hf("RobertaModel", "RobertaConfig", **enc), tokens()),
        Entry(
            "hf_distilbert",
            hf("DistilBertModel", "DistilBertConfig", vocab_size=128, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64),
            tokens(),
        ),
        Entry("hf_albert", hf("AlbertModel", "AlbertConfig", embedding_size=16, **enc), tokens()),
        Entry("hf_electra", hf("ElectraModel", "ElectraConfig", embedding_size=16, **enc), tokens()),
        Entry("hf_deberta_v2", hf("DebertaV2Model", "DebertaV2Config", **enc), tokens()),
    ]
    for name, cls, config, extra in [
        ("llama", "LlamaForCausalLM", "LlamaConfig", {}),
        ("mistral", "MistralForCausalLM", "MistralConfig", {"sliding_window": 8}),
        ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {}),
        ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", {}),
        ("phi3", "Phi3ForCausalLM", "Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
        ("gemma", "GemmaForCausalLM", "GemmaConfig", {}),
        ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", {"sliding_window": 8}),
        ("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", {"sliding_window": 8}),
    ]:
        e.append(Entry(f"hf_{name}", hf(cls, config, **{**DECODER, **extra}), tokens()))
    # MoE routing argsorts int64 expert ids on the CPU
    moe_cpu = "64-bit integers"
    moe = dict(num_local_experts=4, num_experts_per_tok=2)
    qwen_moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    for name, cls, config, extra in [
        # MoE routing: topk over the router's scores, one_hot/index, scatter
        ("mixtral", "MixtralForCausalLM", "MixtralConfig", moe),
        ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(qwen_moe, shared_expert_intermediate_size=32)),
        ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", qwen_moe),
        ("olmoe", "OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
        ("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", moe),
        ("phimoe", "PhimoeForCausalLM", "PhimoeConfig", moe),
        ("gpt_oss", "GptOssForCausalLM", "GptOssConfig", dict(moe, sliding_window=8)),
    ]:
        e.append(Entry(f"hf_{name}", hf(cls, config, **{**DECODER, **extra}), tokens(), cpu_reason=moe_cpu))
    for name, cls, config, extra in [
        ("olmo", "OlmoForCausalLM", "OlmoConfig", {}),
        ("olmo2", "Olmo2ForCausalLM", "Olmo2Config", {}),
        ("olmo3", "Olmo3ForCausalLM", "Olmo3Config", {"sliding_window": 8}),
        ("granite", "GraniteForCausalLM", "GraniteConfig", {}),
        ("stablelm", "StableLmForCausalLM", "StableLmConfig", {}),
        ("phi", "PhiForCausalLM", "PhiConfig", {}),
        ("smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", {"pad_token_id": 0}),
        ("cohere", "CohereForCausalLM", "CohereConfig", {}),
        ("cohere2", "Cohere2ForCausalLM", "Cohere2Config", {"sliding_window": 8}),
        ("glm", "GlmForCausalLM", "GlmConfig", {"pad_token_id": 0}),
        ("glm4", "Glm4ForCausalLM", "Glm4Config", {"pad_token_id": 0}),
        ("helium", "HeliumForCausalLM", "HeliumConfig", {}),
        ("exaone4", "Exaone4ForCausalLM", "Exaone4Config", {"sliding_window": 8}),
        ("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", {}),
        ("ministral", "MinistralForCausalLM", "MinistralConfig", {"sliding_window": 8}),
        ("nemotron", "NemotronForCausalLM", "NemotronConfig", {}),
        ("lfm2", "Lfm2ForCausalLM", "Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
    ]:
        e.append(Entry(f"hf_{name}", hf(cls, config, **{**DECODER, **extra}), tokens()))
    # Hybrid linear-attention and state-space LMs: their recurrences (the
    # chunked gated delta rule, the selective scan, Mamba-2's chunked SSD
    # scan, the causal short convolution) export as loops of ATen ops
    e += [Entry(f"hf_{name}", hf(cls, config, **kw), tokens(), cpu_reason=why) for name, cls, config, kw, why in HYBRID]
    more = [
        ("gpt_neo", "GPTNeoForCausalLM", "GPTNeoConfig", dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=64, use_cache=False)),
        ("codegen", "CodeGenForCausalLM", "CodeGenConfig", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64, use_cache=False)),
        ("mpt", "MptForCausalLM", "MptConfig", dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, use_cache=False)),
        ("modernbert", "ModernBertModel", "ModernBertConfig", dict(SMALL, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0)),
        ("mpnet", "MPNetModel", "MPNetConfig", dict(SMALL)),
        ("deberta", "DebertaModel", "DebertaConfig", dict(SMALL)),
        ("bloom", "BloomForCausalLM", "BloomConfig", dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, use_cache=False)),
        ("falcon", "FalconForCausalLM", "FalconConfig", dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, use_cache=False)),
        ("gptj", "GPTJForCausalLM", "GPTJConfig", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, use_cache=False)),
        ("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", dict(SMALL, num_key_value_heads=2, use_cache=False)),
        ("xlm_roberta", "XLMRobertaModel", "XLMRobertaConfig", dict(SMALL)),
    ]
    for name, cls, config, kw in more:
        e.append(Entry(f"hf_{name}", hf(cls, config, **kw), tokens()))
    e.append(
        Entry(
            "hf_mobilebert",
            hf("MobileBertModel", "MobileBertConfig", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, embedding_size=16, intra_bottleneck_size=16, max_position_embeddings=64),
            tokens(),
        )
    )
    # position_ids instead of a mask: transformers looks for packed sequences (`diff`)
    e.append(
        Entry(
            "hf_llama_position_ids",
            hf("LlamaForCausalLM", "LlamaConfig", keys=("input_ids", "position_ids"), **DECODER),
            lambda g: (torch.randint(0, 128, (1, 12), generator=g), torch.arange(12)[None]),
        )
    )
    e += [
        Entry(
            "hf_gpt2",
            hf("GPT2LMHeadModel", "GPT2Config", bos_token_id=1, eos_token_id=2, vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False),
            tokens(),
        ),
        Entry(
            "hf_gpt_neox",
            hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **dict(SMALL, use_cache=False)),
            tokens(),
        ),
        Entry(
            "hf_opt",
            hf("OPTForCausalLM", "OPTConfig", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64, use_cache=False),
            tokens(),
        ),
    ]
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)
    e += [
        Entry("hf_vit", hf("ViTModel", "ViTConfig", keys=PIXELS, **vision), image(32)),
        Entry("hf_deit", hf("DeiTModel", "DeiTConfig", keys=PIXELS, **vision), image(32)),
        Entry(
            "hf_convnext",
            hf("ConvNextModel", "ConvNextConfig", keys=PIXELS, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], image_size=64),
            image(64),
        ),
        Entry(
            "hf_swin",
            hf("SwinModel", "SwinConfig", keys=PIXELS, image_size=64, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4),
            image(64),
        ),
        Entry("hf_dinov2", hf("Dinov2Model", "Dinov2Config", keys=PIXELS, **vision), image(32)),
        Entry("hf_clip_vision", hf("CLIPVisionModel", "CLIPVisionConfig", keys=PIXELS, **vision), image(32)),
        Entry(
            "hf_segformer",
            hf("SegformerForSemanticSegmentation", "SegformerConfig", keys=PIXELS, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 4, 8], decoder_hidden_size=32, num_labels=3),
            image(64),
        ),
        Entry("hf_wav2vec2", hf("Wav2Vec2Model", "Wav2Vec2Config", **SPEECH), audio),
        Entry("hf_hubert", hf("HubertModel", "HubertConfig", **SPEECH), audio),
        Entry(
            "hf_whisper_encoder",
            hf(
                "WhisperModel",
                "WhisperConfig",
                keys=("input_features",),
                encoder=True,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
                vocab_size=128,
                d_model=32,
                encoder_layers=2,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                num_mel_bins=16,
                max_source_positions=32,
            ),
            lambda g: (torch.randn(1, 16, 64, generator=g),),
        ),
        Entry(
            "hf_t5_encoder",
            hf("T5EncoderModel", "T5Config", vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
            tokens(),
        ),
        Entry(
            "hf_bart_encoder",
            hf(
                "BartModel",
                "BartConfig",
                encoder=True,
                vocab_size=128,
                d_model=32,
                encoder_layers=2,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
            ),
            tokens(),
        ),
    ]
    e += [
        Entry("hf_siglip_vision", hf("SiglipVisionModel", "SiglipVisionConfig", keys=PIXELS, **vision), image(32)),
        Entry("hf_siglip2_vision", hf("Siglip2VisionModel", "Siglip2VisionConfig", keys=("pixel_values", "pixel_attention_mask", "spatial_shapes"), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, patch_size=8, num_patches=16), siglip2_patches),
        Entry("hf_beit", hf("BeitModel", "BeitConfig", keys=PIXELS, use_relative_position_bias=True, **vision), image(32)),
        Entry("hf_dinov2_registers", hf("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", keys=PIXELS, num_register_tokens=4, **vision), image(32)),
        Entry(
            "hf_mobilevit",
            hf("MobileViTModel", "MobileViTConfig", keys=PIXELS, image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=4, initializer_range=0.2),
            image(64),
        ),
        Entry("hf_mobilevitv2", hf("MobileViTV2Model", "MobileViTV2Config", keys=PIXELS, fan_in=True, image_size=64, width_multiplier=0.25), image(64)),
        Entry("hf_convnextv2", hf("ConvNextV2Model", "ConvNextV2Config", keys=PIXELS, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], image_size=64), image(64)),
        Entry(
            "hf_swinv2",
            hf("Swinv2Model", "Swinv2Config", keys=PIXELS, image_size=64, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4),
            image(64),
        ),
        Entry("hf_resnet", hf("ResNetModel", "ResNetConfig", keys=PIXELS, embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]), image(64)),
        Entry("hf_mobilenet_v2", hf("MobileNetV2Model", "MobileNetV2Config", keys=PIXELS, fan_in=True, image_size=64, depth_multiplier=0.35), image(64)),
        Entry("hf_efficientnet", hf("EfficientNetModel", "EfficientNetConfig", keys=PIXELS, fan_in=True, image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320), image(64)),
        Entry("hf_levit", hf("LevitModel", "LevitConfig", keys=PIXELS, fan_in=True, image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[8, 8, 8]), image(64)),
        Entry("hf_pvt_v2", hf("PvtV2Model", "PvtV2Config", keys=PIXELS, image_size=64, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 4, 8]), image(64)),
        Entry("hf_yolos", hf("YolosModel", "YolosConfig", keys=PIXELS, image_size=[32, 32], num_detection_tokens=4, **{k: v for k, v in vision.items() if k != "image_size"}), image(32)),
        Entry("hf_wav2vec2_conformer", hf("Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", position_embeddings_type="relative", **SPEECH), audio),
        Entry("hf_wav2vec2_conformer_rotary", hf("Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", position_embeddings_type="rotary", **SPEECH), audio),
        Entry("hf_wavlm", hf("WavLMModel", "WavLMConfig", num_buckets=16, max_bucket_distance=64, **SPEECH), audio),
        Entry("hf_data2vec_audio", hf("Data2VecAudioModel", "Data2VecAudioConfig", **SPEECH), audio),
        Entry(
            "hf_moonshine_encoder",
            hf("MoonshineModel", "MoonshineConfig", keys=("input_values",), encoder=True, vocab_size=128, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=2, decoder_num_hidden_layers=1, encoder_num_attention_heads=4, decoder_num_attention_heads=4),
            audio,
        ),
    ]
    return e


def siglip2_patches(g):
    """Siglip2's inputs: 16 patches of 8x8x3 (a 4x4 grid), all valid."""
    return torch.randn(1, 16, 192, generator=g), torch.ones(1, 16, dtype=torch.int64), torch.tensor([[4, 4]])


# ---- timm -----------------------------------------------------------------


def timm_entries() -> list[Entry]:
    def t(name, size=64, **kw):
        def make():
            import timm

            return timm.create_model(name, pretrained=False, num_classes=10, **kw)

        return Entry(f"timm_{name}", make, image(size))

    return [
        t("resnet18"),
        t("efficientnet_b0"),
        t("mobilenetv3_small_100"),
        t("convnext_atto"),
        t("vit_tiny_patch16_224", img_size=64),
        t("deit_tiny_patch16_224", img_size=64),
    ]


# Words in the names of the largest torchvision models (hundreds of MB of
# weights): the table runs them last.
LARGE = ("large", "_h_", "_l_", "128gf", "32gf", "16gf", "8gf", "b5", "b6", "b7", "v2_m", "v2_l", "vgg", "101", "152", "161", "169", "201", "_base", "_b")


def entries() -> list[Entry]:
    tv = sorted(torchvision_entries(), key=lambda e: any(w in e.name for w in LARGE))
    return transformers_entries() + timm_entries() + tv


def instantiate(entry: Entry):
    torch.manual_seed(0)
    module = entry.make().eval()
    inputs = entry.inputs(torch.Generator().manual_seed(1))
    return module, inputs


def export(module, inputs) -> torch.export.ExportedProgram:
    return torch.export.export(module, inputs, strict=False)


def targets(ep: torch.export.ExportedProgram) -> Counter:
    return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


SUMMARY = re.compile(r"EtMetalBackend: (\d+) partition\(s\), (\d+) node\(s\), (\d+) kernel\(s\); (\d+) node\(s\) on the cpu")
CPU_NODE = re.compile(r"^  cpu: `[^`]*` \(([^)]*)\): (.*)$", re.M)
# f32 bound on max |etmetal - eager|, relative to max |eager|
REL_TOL = 1e-4


@dataclass
class Outcome:
    """How far one model got: `stage` is the first that failed ("export",
    "compile", "run", "compare") or "ok"."""

    stage: str
    error: str = ""
    partitions: int = 0
    delegated: int = 0
    kernels: int = 0
    cpu: int = 0
    cpu_reasons: list = field(default_factory=list)
    rel_err: float | None = None
    ran_on_gpu: bool = False

    def row(self, name: str) -> str:
        total = self.delegated + self.cpu
        share = f"{self.delegated}/{total} ({100 * self.delegated / total:.0f}%)" if total else "-"
        err = "-" if self.rel_err is None else f"{self.rel_err:.1e}"
        why = self.error.replace("|", "\\|").replace("\n", " ")[:300] or "-"
        cpu = "; ".join(sorted(set(self.cpu_reasons)))[:200] or "-"
        return f"| {name} | {self.stage} | {share} | {self.kernels} | {err} | {cpu} | {why} |"


def check(entry: Entry, binary: Path, work: Path, timeout: int = 900, run: bool = True) -> Outcome:
    """Export `entry`, compile it with `--backend metal`, run it on this
    machine's adapter and compare with eager (`run=False`: stop after the
    compile, at stage "compiled")."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        module, inputs = instantiate(entry)
        with torch.no_grad():
            want = module(*inputs)
            ep = export(module, inputs)
        pt2 = work / f"{entry.name}.pt2"
        torch.export.save(ep, pt2)
    except Exception as ex:  # noqa: BLE001 - recorded as the export stage's failure
        return Outcome("export", f"{type(ex).__name__}: {ex}")

    def call(*args) -> subprocess.CompletedProcess:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)

    pte = work / f"{entry.name}.pte"
    p = call("compile", str(pt2), "-o", str(pte), "--backend", "metal")
    if p.returncode != 0:
        return Outcome("compile", p.stderr.strip())
    m = SUMMARY.search(p.stdout)
    parts, nodes, kernels, cpu = (int(x) for x in m.groups()) if m else (0, 0, 0, 0)
    reasons = [f"{op}: {why}" for op, why in CPU_NODE.findall(p.stdout)]
    out = Outcome("run" if run else "compiled", "", parts, nodes, kernels, cpu, reasons)
    if not run:
        return out
    paths = []
    for i, t in enumerate(inputs):
        np.save(work / f"input_{i}.npy", t.numpy())
        paths.append(str(work / f"input_{i}.npy"))
    out_dir = work / "out"
    p = call("run", str(pte), "--inputs", ",".join(paths), "--output-dir", str(out_dir), "--device", "auto")
    if p.returncode != 0:
        out.error = p.stderr.strip()
        return out
    out.ran_on_gpu = "ran on gpu" in p.stdout
    got = np.load(out_dir / "output_0.npy")
    ref = want.detach().numpy()
    out.stage = "compare"
    if got.shape != ref.shape or got.dtype != ref.dtype:
        out.error = f"got {got.dtype}{list(got.shape)}, want {ref.dtype}{list(ref.shape)}"
        return out
    scale = float(np.abs(ref).max()) or 1.0
    out.rel_err = float(np.abs(got.astype(np.float64) - ref).max()) / scale
    if not out.rel_err <= REL_TOL:
        out.error = f"max abs err {out.rel_err:.2e} x max|ref| (bound {REL_TOL:g})"
        return out
    out.stage = "ok"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", action="store_true", help="print each model's ATen targets")
    ap.add_argument("--table", action="store_true", help="compile and run each model with --bin, print the survey table")
    ap.add_argument("--bin", type=Path, default=None, help="the etmetal binary (default: the release build)")
    ap.add_argument("--compile-only", action="store_true", help="with --table: stop after the compile")
    ap.add_argument("-k", default="", help="only models whose name contains this (comma: any of several)")
    args = ap.parse_args()
    if args.table:
        from runner import default_binary

        binary = args.bin or default_binary()
        if not binary.is_file():
            sys.exit(f"no etmetal binary at {binary}: build it (cargo build --release -p etmetal) or pass --bin")
        print("| model | stage | delegated | kernels | rel err | on cpu (why) | error |")
        print("|---|---|---|---|---|---|---|")
        counts = Counter()
        with tempfile.TemporaryDirectory() as tmp:
            for e in entries():
                if not any(k in e.name for k in args.k.split(",")):
                    continue
                try:
                    o = check(e, binary, Path(tmp) / e.name, run=not args.compile_only)
                except subprocess.TimeoutExpired as ex:
                    o = Outcome("run", f"timed out after {ex.timeout}s")
                counts[o.stage] += 1
                print(o.row(e.name), flush=True)
        print("counts:", dict(counts))
        return
    union = Counter()
    for e in entries():
        if args.k not in e.name:
            continue
        try:
            module, inputs = instantiate(e)
            with torch.no_grad():
                ep = export(module, inputs)
            ts = targets(ep)
            union.update({t: 1 for t in ts})
            print(f"{e.name}: {' '.join(sorted(ts))}", flush=True)
        except Exception as ex:  # noqa: BLE001 - a survey lists every failure
            print(f"{e.name}: EXPORT FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    print("union:", " ".join(f"{t}x{n}" for t, n in sorted(union.items())))


if __name__ == "__main__":
    sys.exit(main())
