"""The corpus, part two: training code as people write it outside the
transformers calling convention (issue 55's kinds of code), small and random.

- ``nanogpt``: the most copied GPT training code's convention, ``model(idx,
  targets)`` returning ``(logits, loss)`` (written here after its shape, not its text);
- ``mixtral``: a mixture-of-experts decoder (top-2 of 4 experts per token);
- ``mamba``: a state-space LM (the sequential scan, as on a CPU without kernels);
- ``llama-lora``: LoRA adapters on every linear of a frozen Llama (``peft``);
- ``llama-gc``: a Llama after ``gradient_checkpointing_enable()``;
- ``bart-layerdrop``: BART with encoder and decoder layerdrop 0.2, a branch on a
  random draw: capture refuses it, naming the line and the switch (the row shows
  the message a user gets);
- ``whisper``: an audio encoder-decoder on log-mel features with labels;
- ``wav2vec2-ctc``: an audio encoder with a CTC head; SpecAugment (numpy draws) and
  layerdrop (a branch on a draw) off, and the loss the user's own (the model's loss
  selects labels by value: a data-dependent shape), as capture's messages say;
- ``clip``: a contrastive two-tower model (text and vision), ``return_loss=True``;
- ``ddpm-unet``: a diffusion U-Net whose step draws the noise and the timesteps;
- ``vae``: a convolutional VAE (reparameterised draw, reconstruction + KL).

Calling conventions besides corpus_models' ``dict`` and ``tuple``: ``kind ==
"call"``: the inputs are the model's positional arguments and its output holds the
loss (a tensor, or the one scalar of a tuple: `capture.outputs.locate_loss`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .corpus_models import (BATCH, D, FFN, HEADS, LAYERS, SEQ, VOCAB, CorpusCase, _BART_LIKE,
                            _LLAMA_LIKE, _hf, _ids, _lm_batch, _seq2seq_batch, _tf)

__all__ = ["TRAINING"]


# -- nanoGPT's convention: model(idx, targets) -> (logits, loss) -------------------------

class _NanoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(0.1))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0,
                                           is_causal=True)
        x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(_NanoBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight        # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def _nanogpt() -> CorpusCase:
    ids = _ids()
    return CorpusCase("nanogpt", "decoder", NanoGPT().train(), (ids, torch.roll(ids, -1, dims=1)),
                      None, "call", "model(idx, targets) -> (logits, loss), tied head, SDPA")


# -- transformers decoders used as people use them ---------------------------------------

def _mixtral() -> CorpusCase:
    t = _tf()
    cfg = t.MixtralConfig(**_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)
    return _hf("mixtral", "decoder", t.MixtralForCausalLM(cfg), _lm_batch(),
               "mixture of experts, top-2 of 4, router aux loss off")


def _mamba() -> CorpusCase:
    t = _tf()
    cfg = t.MambaConfig(vocab_size=VOCAB, hidden_size=D, state_size=8, num_hidden_layers=LAYERS,
                        expand=2, conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        use_cache=False)
    batch = _lm_batch()
    batch.pop("attention_mask")                  # Mamba takes none
    return _hf("mamba", "decoder", t.MambaForCausalLM(cfg), batch, "selective scan (slow path)")


def _llama(**cfg):
    t = _tf()
    return t.LlamaForCausalLM(t.LlamaConfig(**_LLAMA_LIKE, **cfg))


def _llama_lora() -> CorpusCase:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                target_modules="all-linear"))
    return _hf("llama-lora", "decoder", model, _lm_batch(),
               "peft LoRA r=8 on every linear, base frozen, adapter dropout")


def _llama_gc() -> CorpusCase:
    model = _llama()
    model.gradient_checkpointing_enable()
    return _hf("llama-gc", "decoder", model, _lm_batch(), "gradient_checkpointing_enable()")


def _bart_layerdrop() -> CorpusCase:
    t = _tf()
    cfg = t.BartConfig(**_BART_LIKE, encoder_layerdrop=0.2, decoder_layerdrop=0.2)
    return _hf("bart-layerdrop", "enc-dec", t.BartForConditionalGeneration(cfg), _seq2seq_batch(),
               "layerdrop 0.2: a branch on torch.rand, refused at capture")


# -- audio -------------------------------------------------------------------------------

MELS, FRAMES = 16, 64          # Whisper's encoder takes 2 x max_source_positions frames
SAMPLES, CTC_LABELS, CTC_VOCAB = 1600, 8, 16


def _whisper() -> CorpusCase:
    t = _tf()
    cfg = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=MELS, d_model=D, encoder_layers=LAYERS,
                          decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                          decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                          max_source_positions=FRAMES // 2, max_target_positions=SEQ,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                          suppress_tokens=None, begin_suppress_tokens=None)
    labels = _ids(batch=4, seq=SEQ // 2)
    labels[-1, -2:] = -100
    batch = {"input_features": torch.randn(4, MELS, FRAMES), "labels": labels}
    return _hf("whisper", "audio", t.WhisperForConditionalGeneration(cfg), batch,
               "log-mel conv stem, encoder-decoder, labels shifted by the model")


def _ctc_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """CTC over every frame with full-length targets: fixed lengths, so no shape
    depends on the labels' values (the model's own loss masks them out by value).
    The lengths are Python ints: as tensors, CTC's workspace is sized by their
    values and the step would not capture."""
    logp = out.logits.log_softmax(-1).transpose(0, 1)          # (T, B, C)
    t, b = logp.shape[:2]
    return F.ctc_loss(logp, targets, [t] * b, [targets.shape[1]] * b, blank=0, zero_infinity=True)


def _wav2vec2_ctc() -> CorpusCase:
    t = _tf()
    cfg = t.Wav2Vec2Config(vocab_size=CTC_VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                           num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                           conv_kernel=(5, 3), conv_stride=(4, 2), num_conv_pos_embeddings=16,
                           num_conv_pos_embedding_groups=4, apply_spec_augment=False,
                           layerdrop=0.0, pad_token_id=0)
    model = t.Wav2Vec2ForCTC(cfg).train()
    targets = torch.randint(1, CTC_VOCAB, (4, CTC_LABELS))
    return CorpusCase("wav2vec2-ctc", "audio", model, (torch.randn(4, SAMPLES), targets),
                      _ctc_loss, "tuple", "conv feature encoder, CTC head, user's CTC loss")


# -- a contrastive two-tower model ---------------------------------------------------------

def _clip() -> CorpusCase:
    t = _tf()
    text = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=SEQ, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, image_size=32, patch_size=8)
    cfg = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
    ids = _ids(seq=16)
    ids[:, -1] = 2                               # the pooled token is the eos
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "pixel_values": torch.randn(BATCH, 3, 32, 32), "return_loss": True}
    return _hf("clip", "vision", t.CLIPModel(cfg), batch, "text + vision towers, contrastive loss")


# -- generative models people write by hand -------------------------------------------------

def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class _TimeUNet(nn.Module):
    """Two levels, skip connections, a sinusoidal timestep embedding added per level."""

    def __init__(self, ch: int = 16):
        super().__init__()
        self.ch = ch
        self.t_mlp = nn.Sequential(nn.Linear(ch, 2 * ch), nn.SiLU(), nn.Linear(2 * ch, 2 * ch))
        self.down1, self.down2 = _block(3, ch), _block(ch, 2 * ch)
        self.up = nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.dec = _block(2 * ch, ch)
        self.out = nn.Conv2d(ch, 3, 1)

    def forward(self, x, t):
        half = self.ch // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device) / half)
        emb = self.t_mlp(torch.cat([(t[:, None] * freqs).sin(), (t[:, None] * freqs).cos()], 1))
        h1 = self.down1(x)
        h2 = self.down2(F.avg_pool2d(h1, 2)) + emb[:, :, None, None]
        return self.out(self.dec(torch.cat([self.up(h2), h1], 1)))


class DDPM(nn.Module):
    """A DDPM training step as written in notebooks: the model draws the timesteps
    and the noise itself and returns the noise-prediction loss."""

    def __init__(self, steps: int = 100):
        super().__init__()
        self.unet = _TimeUNet()
        self.register_buffer("abar", torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps), 0))

    def forward(self, x0):
        t = torch.randint(0, self.abar.numel(), (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        a = self.abar[t][:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        return F.mse_loss(self.unet(xt, t.float()), noise)


class VAE(nn.Module):
    """A convolutional VAE: encoder to (mu, logvar), a reparameterised draw, decoder;
    the loss is reconstruction + KL, returned by forward."""

    def __init__(self, ch: int = 16, z: int = 8):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, ch, 4, 2, 1), nn.ReLU(), nn.Conv2d(ch, 2 * ch, 4, 2, 1),
                                 nn.ReLU(), nn.Conv2d(2 * ch, 2 * z, 1))
        self.dec = nn.Sequential(nn.Conv2d(z, 2 * ch, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(2 * ch, ch, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(ch, 3, 4, 2, 1))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=1)
        zs = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon = F.mse_loss(self.dec(zs), x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.shape[0]
        return recon + kl


def _image_model(name, make, description) -> Callable[[], CorpusCase]:
    def build() -> CorpusCase:
        return CorpusCase(name, "torch", make().train(), (torch.randn(BATCH, 3, 32, 32),), None,
                          "call", description)
    return build


# name -> (family, builder), merged into corpus_models.MODELS
TRAINING: dict[str, tuple[str, Callable[[], CorpusCase]]] = {
    "nanogpt": ("decoder", _nanogpt),
    "mixtral": ("decoder", _mixtral),
    "mamba": ("decoder", _mamba),
    "llama-lora": ("decoder", _llama_lora),
    "llama-gc": ("decoder", _llama_gc),
    "bart-layerdrop": ("enc-dec", _bart_layerdrop),
    "whisper": ("audio", _whisper),
    "wav2vec2-ctc": ("audio", _wav2vec2_ctc),
    "clip": ("vision", _clip),
    "ddpm-unet": ("torch", _image_model("ddpm-unet", DDPM, "U-Net, noise and timesteps drawn in the step")),
    "vae": ("torch", _image_model("vae", VAE, "conv VAE, reparameterised draw, recon + KL")),
}
