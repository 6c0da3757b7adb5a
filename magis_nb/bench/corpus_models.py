"""The corpus: real architectures, small and random, built the way users build them.

Every model is built from its config class (``XxxConfig(...)`` then the model
class): random weights, nothing downloaded (no weights, tokenizers or data; the
Hub is switched off before `transformers` is imported). Sizes are small enough
for one CPU training step in well under a second or two: batch 2-4, sequences of
32 tokens, images of 32-64 px, hidden sizes of 16-64, two layers or stages where
the config allows.

Calling conventions, as users write them:

- ``kind == "dict"``: Hugging Face models get one dict batch,
  ``{"input_ids", "attention_mask", "labels"}`` (or ``{"pixel_values", "labels"}``)
  and compute their own loss: ``model(**batch).loss``; ``loss_fn`` is None.
- ``kind == "tuple"``: plain PyTorch models get ``(inputs..., target)`` and a
  ``loss_fn(output, target)``, magis_nb's own convention.
- ``kind == "call"``: the model's arguments; its output holds the loss (the
  models of `corpus_training`, merged into `MODELS`).

Text batches pad the last sample's last 4 tokens (``attention_mask`` 0, label
-100), as a collator does. Configs keep their default dropout (and drop-path
where the config has one): a step compares against eager from the same RNG seed.

`MODELS` maps name -> (family, builder); `build(name, seed)` builds one with the
global RNG forked and seeded (the caller's RNG is left as it was).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# Never reach the Hub: everything below is built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__all__ = ["CorpusCase", "MODELS", "TRAINING", "FAMILIES", "LM_FAMILIES", "names", "build", "eager_loss"]

BATCH, SEQ, VOCAB = 8, 64, 128
PAD_LAST = 4            # the last sample's last tokens are padding
D, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
IMG_VIT, IMG_CNN, LABELS = 32, 64, 10

FAMILIES = ("decoder", "encoder", "enc-dec", "vision", "cnn", "torch", "audio")
LM_FAMILIES = ("decoder", "encoder", "enc-dec")   # "LMs" in the bench summary


@dataclass
class CorpusCase:
    name: str
    family: str
    model: nn.Module
    inputs: Any                  # a dict batch ("dict"), (inputs..., target) ("tuple"),
                                 # or the model's arguments ("call")
    loss_fn: Callable | None     # None: the model computes its own loss
    kind: str                    # "dict" | "tuple" | "call" (see corpus_training)
    description: str = ""


def _tf():
    import transformers
    return transformers


# -- inputs -----------------------------------------------------------------------

def _mask(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    m = torch.ones(batch, seq, dtype=torch.long)
    m[-1, seq - PAD_LAST:] = 0
    return m


def _ids(batch: int = BATCH, seq: int = SEQ, low: int = 3) -> torch.Tensor:
    # ids 0-2 are left to the special tokens (pad/bos/eos) of every config below
    return torch.randint(low, VOCAB, (batch, seq))


def _lm_batch() -> dict:
    """Causal LM: labels are the input ids (the model shifts them), -100 on padding."""
    ids, mask = _ids(), _mask()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _mlm_batch() -> dict:
    """Masked LM: 15% of the real tokens are predicted (the rest -100)."""
    ids, mask = _ids(), _mask()
    pick = (torch.rand(ids.shape) < 0.15) & (mask == 1)
    pick[:, 1] = True                      # at least one prediction per sample
    labels = ids.masked_fill(~pick, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _cls_batch() -> dict:
    """Sequence classification: one label per sample."""
    return {"input_ids": _ids(), "attention_mask": _mask(),
            "labels": torch.randint(0, LABELS, (BATCH,))}


def _seq2seq_batch() -> dict:
    """Encoder-decoder: source ids and mask, target labels (the model builds the
    decoder inputs by shifting them right), -100 on the target's padding."""
    ids, mask = _ids(), _mask()
    labels = _ids(seq=SEQ // 2)
    labels[-1, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _image_batch(size: int) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, size, size),
            "labels": torch.randint(0, LABELS, (BATCH,))}


def _hf(name, family, model, batch, description) -> CorpusCase:
    model.train()
    return CorpusCase(name, family, model, batch, None, "dict", description)


# -- decoder LMs ---------------------------------------------------------------------

_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                   max_position_embeddings=2 * SEQ, **_SPECIAL)


def _decoder(name, cls, cfg_cls, description, **cfg) -> Callable[[], CorpusCase]:
    def build() -> CorpusCase:
        t = _tf()
        config = getattr(t, cfg_cls)(**cfg)
        model = getattr(t, cls)(config)
        return _hf(name, "decoder", model, _lm_batch(), description)
    return build


DECODERS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", "learned positions, LayerNorm, tied head",
             dict(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                  n_inner=FFN, **_SPECIAL)),
    "gpt-neo": ("GPTNeoForCausalLM", "GPTNeoConfig", "global + local (window 8) attention",
                dict(vocab_size=VOCAB, max_position_embeddings=2 * SEQ, hidden_size=D, num_layers=LAYERS,
                     num_heads=HEADS, intermediate_size=FFN, window_size=8,
                     attention_types=[[["global", "local"], LAYERS // 2]], **_SPECIAL)),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", "partial rotary (25%), parallel residual",
                 dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=FFN, max_position_embeddings=2 * SEQ, rotary_pct=0.25,
                      **_SPECIAL)),
    "gpt-j": ("GPTJForCausalLM", "GPTJConfig", "interleaved rotary (8 dims), parallel block",
              dict(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                   rotary_dim=8, n_inner=FFN, **_SPECIAL)),
    "opt": ("OPTForCausalLM", "OPTConfig", "learned offset positions, ReLU",
            dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, ffn_dim=FFN,
                 num_attention_heads=HEADS, max_position_embeddings=2 * SEQ, word_embed_proj_dim=D,
                 **_SPECIAL)),
    "bloom": ("BloomForCausalLM", "BloomConfig", "ALiBi, embedding LayerNorm",
              dict(vocab_size=VOCAB, hidden_size=D, n_layer=LAYERS, n_head=HEADS, **_SPECIAL)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", "rotary, GQA 4/2, RMSNorm, SwiGLU",
              dict(_LLAMA_LIKE)),
    "mistral": ("MistralForCausalLM", "MistralConfig", "rotary, GQA, sliding window 16",
                dict(_LLAMA_LIKE, sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "rotary, GQA, qkv bias",
              dict(_LLAMA_LIKE)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "rotary, GQA, q/k RMSNorm",
              dict(_LLAMA_LIKE, head_dim=D // HEADS)),
    "phi": ("PhiForCausalLM", "PhiConfig", "partial rotary (50%), parallel block, LayerNorm",
            dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, max_position_embeddings=2 * SEQ, partial_rotary_factor=0.5,
                 **_SPECIAL)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", "fused qkv / gate-up, rotary, GQA",
             dict(_LLAMA_LIKE, original_max_position_embeddings=2 * SEQ)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", "rotary, GQA, (1+w) RMSNorm, GeGLU, scaled embeddings",
              dict(_LLAMA_LIKE, head_dim=D // HEADS)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", "soft-capping, alternating sliding window",
               dict(_LLAMA_LIKE, head_dim=D // HEADS, sliding_window=16)),
    "falcon": ("FalconForCausalLM", "FalconConfig", "multi-query attention, parallel block, rotary",
               dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    max_position_embeddings=2 * SEQ, **_SPECIAL)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", "partial rotary, LayerNorm, GQA",
                 dict(_LLAMA_LIKE)),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", "non-parametric LayerNorm, rotary",
             dict(_LLAMA_LIKE)),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", "fused qkv, interleaved rotary",
                dict(vocab_size=VOCAB, n_positions=2 * SEQ, n_ctx=2 * SEQ, n_embd=D, n_layer=LAYERS,
                     n_head=HEADS, rotary_dim=8, n_inner=FFN, **_SPECIAL)),
    "gpt-bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", "multi-query attention, learned positions",
                    dict(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                         n_inner=FFN, multi_query=True, **_SPECIAL)),
}


# -- encoders ------------------------------------------------------------------------

_BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, max_position_embeddings=2 * SEQ)


def _encoder(name, cls, cfg_cls, batch, description, **cfg) -> Callable[[], CorpusCase]:
    def build() -> CorpusCase:
        t = _tf()
        model = getattr(t, cls)(getattr(t, cfg_cls)(**cfg))
        return _hf(name, "encoder", model, batch(), description)
    return build


ENCODERS = {
    "bert": ("BertForMaskedLM", "BertConfig", _mlm_batch, "masked LM, tied decoder",
             dict(_BERT_LIKE, pad_token_id=0)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", _mlm_batch, "masked LM, padding-offset positions",
                dict(_BERT_LIKE, max_position_embeddings=2 * SEQ + 2, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2)),
    "distilbert": ("DistilBertForSequenceClassification", "DistilBertConfig", _cls_batch,
                   "sequence classification",
                   dict(vocab_size=VOCAB, dim=D, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
                        max_position_embeddings=2 * SEQ, num_labels=LABELS, pad_token_id=0)),
    "albert": ("AlbertForMaskedLM", "AlbertConfig", _mlm_batch, "shared layers, factorized embedding",
               dict(_BERT_LIKE, embedding_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "electra": ("ElectraForSequenceClassification", "ElectraConfig", _cls_batch,
                "sequence classification, embedding projection",
                dict(_BERT_LIKE, embedding_size=32, num_labels=LABELS, pad_token_id=0)),
    "deberta-v2": ("DebertaV2ForSequenceClassification", "DebertaV2Config", _cls_batch,
                   "disentangled relative attention (c2p, p2c), position buckets",
                   dict(_BERT_LIKE, relative_attention=True, pos_att_type=["p2c", "c2p"],
                        position_buckets=16, max_relative_positions=-1, position_biased_input=False,
                        num_labels=LABELS, pad_token_id=0)),
}


# -- encoder-decoders --------------------------------------------------------------------

_BART_LIKE = dict(vocab_size=VOCAB, d_model=D, encoder_layers=LAYERS, decoder_layers=LAYERS,
                  encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                  decoder_ffn_dim=FFN, max_position_embeddings=2 * SEQ,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _encdec(name, cls, cfg_cls, description, **cfg) -> Callable[[], CorpusCase]:
    def build() -> CorpusCase:
        t = _tf()
        model = getattr(t, cls)(getattr(t, cfg_cls)(**cfg))
        return _hf(name, "enc-dec", model, _seq2seq_batch(), description)
    return build


ENC_DECS = {
    "t5": ("T5ForConditionalGeneration", "T5Config", "relative position buckets, RMSNorm, tied head",
           dict(vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=FFN, num_layers=LAYERS,
                num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)),
    "bart": ("BartForConditionalGeneration", "BartConfig", "learned positions, post-LN",
             dict(_BART_LIKE)),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", "sinusoidal positions, pre-LN",
                dict(_BART_LIKE)),
    "marian": ("MarianMTModel", "MarianConfig", "sinusoidal positions, scaled embeddings",
               dict(_BART_LIKE)),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", "pre-LN, final encoder/decoder LayerNorm",
              dict(_BART_LIKE)),
}


# -- vision transformers and CNNs ------------------------------------------------------------

_VIT_LIKE = dict(image_size=IMG_VIT, patch_size=8, num_channels=3, hidden_size=D,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                 num_labels=LABELS)


def _image(name, family, cls, cfg_cls, size, description, **cfg) -> Callable[[], CorpusCase]:
    def build() -> CorpusCase:
        t = _tf()
        model = getattr(t, cls)(getattr(t, cfg_cls)(**cfg))
        return _hf(name, family, model, _image_batch(size), description)
    return build


VISION = {
    "vit": ("ViTForImageClassification", "ViTConfig", IMG_VIT, "patch 8, CLS token", dict(_VIT_LIKE)),
    "deit": ("DeiTForImageClassification", "DeiTConfig", IMG_VIT, "CLS + distillation tokens",
             dict(_VIT_LIKE)),
    "swin": ("SwinForImageClassification", "SwinConfig", IMG_VIT,
             "windowed attention (window 4), shifted windows, patch merging, drop path",
             dict(image_size=IMG_VIT, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2],
                  num_heads=[2, 4], window_size=4, num_labels=LABELS)),
    "beit": ("BeitForImageClassification", "BeitConfig", IMG_VIT,
             "relative position bias, layer scale, mean pooling, drop path",
             dict(_VIT_LIKE, use_relative_position_bias=True, use_mean_pooling=True)),
    "levit": ("LevitForImageClassification", "LevitConfig", IMG_CNN,
              "conv stem, BatchNorm1d after every linear (channels viewed as heads), "
              "attention biases gathered by index, subsampling attention",
              dict(image_size=IMG_CNN, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2],
                   depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=LABELS)),
}

_STAGES = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
CNNS = {
    "resnet": ("ResNetForImageClassification", "ResNetConfig", IMG_CNN, "basic blocks, BatchNorm",
               dict(num_channels=3, embedding_size=16, layer_type="basic", num_labels=LABELS, **_STAGES)),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", IMG_CNN,
                 "depthwise 7x7, channels-last LayerNorm, layer scale",
                 dict(num_channels=3, num_stages=4, num_labels=LABELS, **_STAGES)),
    "mobilenet-v2": ("MobileNetV2ForImageClassification", "MobileNetV2Config", IMG_CNN,
                     "inverted residuals, ReLU6, depth multiplier 0.35",
                     dict(num_channels=3, image_size=IMG_CNN, depth_multiplier=0.35, num_labels=LABELS)),
    "efficientnet": ("EfficientNetForImageClassification", "EfficientNetConfig", IMG_CNN,
                     "MBConv, squeeze-excitation, SiLU, drop connect",
                     dict(num_channels=3, image_size=IMG_CNN, width_coefficient=0.25, depth_coefficient=0.3,
                          hidden_dim=320, num_labels=LABELS)),
    "regnet": ("RegNetForImageClassification", "RegNetConfig", IMG_CNN, "grouped convs, squeeze-excitation (Y)",
               dict(num_channels=3, embedding_size=16, groups_width=8, layer_type="y", num_labels=LABELS,
                    **_STAGES)),
}


# -- plain PyTorch models -----------------------------------------------------------------

def _token_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


class TorchEncoderLM(nn.Module):
    """nn.TransformerEncoder with a causal mask, embedding and head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        layer = nn.TransformerEncoderLayer(D, HEADS, FFN, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.emb(ids) + self.pos[:t]
        return self.head(self.enc(x, mask=mask, is_causal=True))


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D), nn.Dropout(0.1))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHALM(nn.Module):
    """nn.MultiheadAttention blocks with a boolean causal mask made in forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        t = ids.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), diagonal=1)
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


class RNNLM(nn.Module):
    """Embedding, a 2-layer nn.LSTM / nn.GRU (dropout between layers), head."""

    def __init__(self, cell: type):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.rnn = cell(D, D, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


class CkptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class CheckpointedMLP(nn.Module):
    """Residual MLP blocks, each run under torch.utils.checkpoint (non-reentrant),
    as users write activation checkpointing by hand."""

    def __init__(self, blocks: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(CkptBlock() for _ in range(blocks))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        from torch.utils.checkpoint import checkpoint

        x = self.emb(ids)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def _torch(name, make, description) -> Callable[[], CorpusCase]:
    def build() -> CorpusCase:
        model = make()
        model.train()
        ids = _ids()
        target = torch.roll(ids, -1, dims=1)
        return CorpusCase(name, "torch", model, (ids, target), _token_ce, "tuple", description)
    return build


TORCH = {
    "torch-transformer": (TorchEncoderLM, "nn.TransformerEncoder, pre-LN, causal mask"),
    "torch-mha": (MHALM, "nn.MultiheadAttention blocks, bool causal mask built in forward"),
    "torch-lstm": (lambda: RNNLM(nn.LSTM), "2-layer nn.LSTM LM"),
    "torch-gru": (lambda: RNNLM(nn.GRU), "2-layer nn.GRU LM"),
    "torch-checkpoint": (CheckpointedMLP, "4 MLP blocks under torch.utils.checkpoint (use_reentrant=False)"),
}


# -- the registry ---------------------------------------------------------------------------

MODELS: dict[str, tuple[str, Callable[[], CorpusCase]]] = {}
for _n, (_cls, _cfg, _d, _kw) in DECODERS.items():
    MODELS[_n] = ("decoder", _decoder(_n, _cls, _cfg, _d, **_kw))
for _n, (_cls, _cfg, _batch, _d, _kw) in ENCODERS.items():
    MODELS[_n] = ("encoder", _encoder(_n, _cls, _cfg, _batch, _d, **_kw))
for _n, (_cls, _cfg, _d, _kw) in ENC_DECS.items():
    MODELS[_n] = ("enc-dec", _encdec(_n, _cls, _cfg, _d, **_kw))
for _n, (_cls, _cfg, _size, _d, _kw) in VISION.items():
    MODELS[_n] = ("vision", _image(_n, "vision", _cls, _cfg, _size, _d, **_kw))
for _n, (_cls, _cfg, _size, _d, _kw) in CNNS.items():
    MODELS[_n] = ("cnn", _image(_n, "cnn", _cls, _cfg, _size, _d, **_kw))
for _n, (_make, _d) in TORCH.items():
    MODELS[_n] = ("torch", _torch(_n, _make, _d))
# last: corpus_training builds on the names above (this module is half-imported then)
from .corpus_training import TRAINING  # noqa: E402

MODELS.update(TRAINING)


def names(family: str | None = None) -> list[str]:
    """Registry names (of one family), in registry order."""
    return [n for n, (f, _) in MODELS.items() if family is None or f == family]


def build(name: str, seed: int = 0) -> CorpusCase:
    """Build corpus model ``name``: weights and inputs drawn from ``seed``; the
    caller's global RNG is left as it was."""
    if name not in MODELS:
        raise KeyError(f"unknown corpus model {name!r}; known: {', '.join(MODELS)}")
    family, builder = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        case = builder()
    assert case.family == family, (name, case.family, family)
    return case


def eager_loss(case: CorpusCase, backward: bool = True) -> torch.Tensor:
    """One eager training step the way a user writes it: the loss (and .grad):
    ``model(**batch).loss``, ``loss_fn(model(*xs), target)`` or the loss the
    model's output holds (capture's own calling convention)."""
    from ..capture.export import call_step

    loss = call_step(case.model, case.inputs, case.loss_fn)
    if backward:
        loss.backward()
    return loss.detach()
