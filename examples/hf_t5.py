"""A Hugging Face T5 (encoder-decoder), built from its config (random weights: nothing is
downloaded).

``build_model`` is a tiny T5 (4 encoder and 4 decoder blocks, d_model 64) that plans in
seconds on a CPU; the published T5 v1.0 shapes are named factories:

    autopipe plan examples/hf_t5.py --gpus 4
    autopipe plan examples/hf_t5.py --gpus 4 --units 'encoder.block.*,decoder.block.*'
    autopipe plan examples/hf_t5.py:t5_large --gpus 8 --device a100-80gb

Both stacks are split into their blocks; the shared embedding is one parameter tied across
the encoder, the decoder and the LM head (each stage that uses it holds a copy, gradients
summed). The inputs carry ``labels``, so the model returns its own loss.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config needs no hub; make sure none is asked

import torch  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402

TINY_VOCAB = 1024
T5_VOCAB = 32128
SOURCE_LEN = 64
TARGET_LEN = 32


def _t5(**shape: int) -> T5ForConditionalGeneration:
    config = T5Config(
        dropout_rate=0.0,
        use_cache=False,  # training: no key/value cache
        tie_word_embeddings=True,
        decoder_start_token_id=0,
        pad_token_id=0,
        **shape,
    )
    torch.manual_seed(0)  # every rank of `autopipe run` builds the same weights
    return T5ForConditionalGeneration(config)


def build_model() -> T5ForConditionalGeneration:
    """A tiny T5: 4 + 4 blocks, d_model 64, vocabulary 1024 (about 0.4 M parameters)."""
    return _t5(
        vocab_size=TINY_VOCAB, d_model=64, d_kv=16, d_ff=128,
        num_layers=4, num_decoder_layers=4, num_heads=4,
    )  # fmt: skip


def example_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Source ids (batch_size, 64) and target labels (batch_size, 32), int64."""
    return _pairs(batch_size, TINY_VOCAB)


def t5_small() -> T5ForConditionalGeneration:
    """T5-Small: 6 + 6 blocks, d_model 512, d_ff 2048, 8 heads (60 M parameters)."""
    return _t5(
        vocab_size=T5_VOCAB, d_model=512, d_kv=64, d_ff=2048,
        num_layers=6, num_decoder_layers=6, num_heads=8,
    )  # fmt: skip


def t5_base() -> T5ForConditionalGeneration:
    """T5-Base: 12 + 12 blocks, d_model 768, d_ff 3072, 12 heads (220 M parameters)."""
    return _t5(
        vocab_size=T5_VOCAB, d_model=768, d_kv=64, d_ff=3072,
        num_layers=12, num_decoder_layers=12, num_heads=12,
    )  # fmt: skip


def t5_large() -> T5ForConditionalGeneration:
    """T5-Large: 24 + 24 blocks, d_model 1024, d_ff 4096, 16 heads (740 M parameters)."""
    return _t5(
        vocab_size=T5_VOCAB, d_model=1024, d_kv=64, d_ff=4096,
        num_layers=24, num_decoder_layers=24, num_heads=16,
    )  # fmt: skip


def _t5_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Source ids (batch_size, 64) and target labels (batch_size, 32), int64."""
    return _pairs(batch_size, T5_VOCAB)


example_inputs_t5_small = example_inputs_t5_base = example_inputs_t5_large = _t5_inputs


def _pairs(batch_size: int, vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(1, vocab_size, (batch_size, SOURCE_LEN), generator=g),
        "labels": torch.randint(1, vocab_size, (batch_size, TARGET_LEN), generator=g),
    }
