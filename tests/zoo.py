"""The model zoo: third-party models built from tiny configs (random weights, no download).

A model file in autopipe's convention, one factory per family: ``autopipe plan
tests/zoo.py:llama --gpus 2`` or ``torchrun ... -m autopipe run tests/zoo.py:t5 ...``.
Each ``FAMILY()`` builds the model seeded (the same weights in every process) with dropout
off, and ``example_inputs_FAMILY(batch_size)`` gives seeded inputs. Hugging Face families need
``transformers``, the torchvision ones ``torchvision``; :data:`FAMILIES` lists what this
machine can build. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import shared_layers_models  # the model file's folder is on sys.path while it loads
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for a hub

SEQ = 8
VOCAB = 64


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torchvision_works() -> bool:
    """torchvision from PyPI can fail to load its operators beside a local torch build."""
    if not _has("torchvision"):
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


HF_FAMILIES = [
    "llama",
    "qwen2",
    "mistral",
    "mixtral",
    "gpt2",
    "t5",
    "vit",
    "llama_labels",
    "bert",
    "albert",
    "gemma3",
    "swin",
    "qwen2_moe",
    "wav2vec2",
    "wav2vec2_masked",
]
TORCHVISION_FAMILIES = ["resnet50", "vit_b_16"]
FAMILIES = (HF_FAMILIES if _has("transformers") else []) + (
    TORCHVISION_FAMILIES if _torchvision_works() else []
)


def _ids(batch_size: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def _padding_mask(batch_size: int) -> torch.Tensor:
    """Left padding of a different length per row (0 = padding), as a batched tokenizer makes."""
    mask = torch.ones(batch_size, SEQ, dtype=torch.long)
    for row in range(batch_size):
        mask[row, : row % 3] = 0
    return mask


def decoder_config(cls_name: str, **extra: Any) -> Any:
    """The tiny decoder every Hugging Face family here is built on (hidden 32, 4 heads, 2
    key/value heads, 2 layers, vocabulary VOCAB), ``extra`` its family's own fields; also
    tests/tp_models.py's."""
    import transformers

    cls = getattr(transformers, cls_name)
    return cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        use_cache=False,
        attention_dropout=0.0,
        **extra,
    )


def _seeded(build: Any) -> nn.Module:
    torch.manual_seed(0)
    return build()


# -- decoder LMs ---------------------------------------------------------------------------


def llama() -> nn.Module:
    import transformers

    return _seeded(lambda: transformers.LlamaForCausalLM(decoder_config("LlamaConfig")))


def example_inputs_llama(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size)}


def qwen2() -> nn.Module:
    import transformers

    return _seeded(lambda: transformers.Qwen2ForCausalLM(decoder_config("Qwen2Config")))


def example_inputs_qwen2(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size), "attention_mask": _padding_mask(batch_size)}


def mistral() -> nn.Module:
    import transformers

    return _seeded(lambda: transformers.MistralForCausalLM(decoder_config("MistralConfig")))


def example_inputs_mistral(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size), "attention_mask": _padding_mask(batch_size)}


def mixtral() -> nn.Module:
    import transformers

    cfg = decoder_config(
        "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    return _seeded(lambda: transformers.MixtralForCausalLM(cfg))


def example_inputs_mixtral(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size)}


def gpt2() -> nn.Module:
    """GPT-2: the token embedding is tied to the LM head (first and last stage)."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=4 * SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def example_inputs_gpt2(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size)}


def llama_labels() -> nn.Module:
    """A causal LM called with ``labels=``: its output carries ``.loss``."""
    return llama()


def example_inputs_llama_labels(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Fine-tuning's common case: left padding, labelled ``-100`` where padded, so the rows
    hold different numbers of labelled tokens (the loss is a mean over those)."""
    ids = _ids(batch_size)
    mask = _padding_mask(batch_size)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gemma3() -> nn.Module:
    """Gemma-3: sliding-window and global layers; its forward iterates a ``set`` of layer
    types, whose order follows the process's hash seed."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4 * SEQ,
        sliding_window=4,
        use_cache=False,
        attention_dropout=0.0,
    )
    return _seeded(lambda: transformers.Gemma3ForCausalLM(cfg))


def example_inputs_gemma3(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size)}


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE: routed experts beside a gated shared expert in every layer."""
    import transformers

    cfg = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        use_cache=False,
    )
    return _seeded(lambda: transformers.Qwen2MoeForCausalLM(cfg))


def example_inputs_qwen2_moe(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size)}


# -- encoders ------------------------------------------------------------------------------


def bert() -> nn.Module:
    """BERT masked LM: the word embedding tied to the MLM decoder."""
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=4 * SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _seeded(lambda: transformers.BertForMaskedLM(cfg))


def albert() -> nn.Module:
    """ALBERT masked LM: one layer applied at all 4 depths (parameter sharing), so one unit
    per call (``...albert_layer_groups.0#k``) and a tied parameter across every cut."""
    return shared_layers_models.albert()


def example_inputs_albert(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return example_inputs_bert(batch_size)


def example_inputs_bert(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """About 40% of the tokens labelled, a different number per row (the rest ``-100``)."""
    ids = _ids(batch_size)
    g = torch.Generator().manual_seed(3)
    masked = torch.rand(batch_size, SEQ, generator=g) < 0.4
    return {"input_ids": ids, "labels": ids.masked_fill(~masked, -100)}


# -- encoder-decoder -----------------------------------------------------------------------


def t5() -> nn.Module:
    """T5: one shared embedding tied across the encoder, the decoder and the LM head."""
    import transformers

    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        tie_word_embeddings=True,
        decoder_start_token_id=0,
    )
    return _seeded(lambda: transformers.T5ForConditionalGeneration(cfg))


def example_inputs_t5(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch_size), "decoder_input_ids": _ids(batch_size, seed=2)}


# -- vision --------------------------------------------------------------------------------


def vit() -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _seeded(lambda: transformers.ViTForImageClassification(cfg))


def example_inputs_vit(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 3, 16, 16, generator=g)


def swin() -> nn.Module:
    """Swin: shifted windows, relative position bias tables and index buffers."""
    import transformers

    cfg = transformers.SwinConfig(
        image_size=16,
        patch_size=2,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=2,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    return _seeded(lambda: transformers.SwinForImageClassification(cfg))


def example_inputs_swin(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 3, 16, 16, generator=g)


# -- audio ---------------------------------------------------------------------------------


def _wav2vec2_config(**extra: Any) -> Any:
    import transformers

    return transformers.Wav2Vec2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=0.0,
        final_dropout=0.0,
        **extra,
    )


AUDIO_SAMPLES = 400
"""Raw audio samples per row (18 frames after the feature encoder)."""


def wav2vec2() -> nn.Module:
    """wav2vec2 with a CTC head: a convolutional feature encoder over raw audio, then a
    Transformer. Its forward takes no mask, so SpecAugment is off (``mask_time_prob=0``):
    the mask forward would draw with numpy is refused (autopipe.profiler.trace)."""
    import transformers

    return _seeded(lambda: transformers.Wav2Vec2ForCTC(_wav2vec2_config(mask_time_prob=0.0)))


def example_inputs_wav2vec2(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, AUDIO_SAMPLES, generator=g)


def wav2vec2_masked() -> nn.Module:
    """The wav2vec2 encoder trained with SpecAugment as configured (``mask_time_prob``
    0.3): the mask is drawn outside the model, per batch, and passed in as
    ``mask_time_indices``, as transformers' pretraining collator does."""
    import transformers

    cfg = _wav2vec2_config(mask_time_prob=0.3, mask_time_length=2)
    return _seeded(lambda: transformers.Wav2Vec2Model(cfg))


def example_inputs_wav2vec2_masked(batch_size: int = 8) -> dict[str, torch.Tensor]:
    import numpy as np
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices

    cfg = _wav2vec2_config()
    frames = AUDIO_SAMPLES
    for kernel, stride in zip(cfg.conv_kernel, cfg.conv_stride, strict=True):
        frames = (frames - kernel) // stride + 1
    state = np.random.get_state()  # transformers draws from numpy's global generator
    np.random.seed(1)
    try:
        mask = _compute_mask_indices((batch_size, frames), 0.3, 2, min_masks=2)
    finally:
        np.random.set_state(state)
    return {
        "input_values": example_inputs_wav2vec2(batch_size),
        "mask_time_indices": torch.from_numpy(mask),
    }


def resnet50() -> nn.Module:
    import torchvision

    return _seeded(lambda: torchvision.models.resnet50(num_classes=10))


def example_inputs_resnet50(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 3, 32, 32, generator=g)


def vit_b_16() -> nn.Module:
    import torchvision

    # vit_b_16's architecture (VisionTransformer, patch 16) at test size.
    return _seeded(
        lambda: torchvision.models.VisionTransformer(
            image_size=32,
            patch_size=16,
            num_layers=2,
            num_heads=4,
            hidden_dim=32,
            mlp_dim=64,
            num_classes=10,
        )
    )


def example_inputs_vit_b_16(batch_size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 3, 32, 32, generator=g)


def build_model() -> nn.Module:
    return llama()


def example_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return example_inputs_llama(batch_size)


# -- the zoo's training runs: plans for 2 ranks ----------------------------------------------

# Each family trains under its own schedule, so every schedule runs on a model this project
# did not write (one launch for all): (schedule, V chunks per rank).
SCHEDULE_OF = {
    "llama": ("gpipe", 1),
    "qwen2": ("1f1b", 1),
    "mistral": ("interleaved-1f1b", 2),
    "mixtral": ("interleaved-zb", 2),
    "gpt2": ("zbv", 2),  # the tied embedding and head both on rank 0 (the V's two ends)
    "t5": ("dualpipev", 2),
    "vit": ("looped-bfs", 2),
    "llama_labels": ("zbv", 2),
    "resnet50": ("1f1b", 1),
    "vit_b_16": ("interleaved-zb", 2),
    "bert": ("1f1b", 1),
    "albert": ("interleaved-zb", 2),
    "gemma3": ("interleaved-1f1b", 2),
    "swin": ("gpipe", 1),
    "qwen2_moe": ("zbv", 2),
    "wav2vec2": ("looped-bfs", 2),
    "wav2vec2_masked": ("1f1b", 1),
}
CUTS = ("planned", "other")
"""Every family trains twice: the planner's cut and :func:`second_cut`."""


def second_cut(measured: Any, planned: Any) -> Any:
    """Another cut of the same request than the planner's: equal unit counts (torch's and
    Megatron's rule), balanced parameter counts (DeepSpeed's) or torchgpipe's time
    balance, whichever differs first; else the plan with its first cut moved by one unit."""
    from autopipe.planner import plan as make_plan

    for strategy in ("uniform", "parameters", "greedy-time"):
        other = make_plan(measured, dataclasses.replace(planned.request, strategy=strategy))
        if other.balance != planned.balance:
            return other
    cut = [list(s.units) for s in planned.stages]
    if len(cut[0]) > 1:
        cut[1].insert(0, cut[0].pop())  # the first cut one unit earlier
    else:
        cut[0].append(cut[1].pop(0))  # or one unit later
    return recut(planned, cut)


def recut(plan: Any, cut: list[list[str]]) -> Any:
    """``plan`` with its units cut into ``cut`` by hand (the same units in order, one list
    per chunk), each unit's parameter record moving with it."""
    counts = dict(
        zip(
            (u for s in plan.stages for u in s.units),
            (n for s in plan.stages for n in s.unit_parameters),
            strict=False,
        )
    )
    stages = [
        dataclasses.replace(
            s, units=units, unit_parameters=[counts[u] for u in units] if counts else []
        )
        for s, units in zip(plan.stages, cut, strict=True)
    ]
    return dataclasses.replace(plan, stages=stages)


def write_plans(out: Any, families: list[str], profiles: dict[str, Any] | None = None) -> None:
    """``OUT/FAMILY.CUT.plan.json`` for every family and cut: 2 ranks, M = 4, SGD, the
    family's schedule, from its saved measured profile (``profiles[family]``, a path) or
    one measured here."""
    from autopipe.planner import plan as make_plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.profile import Profile
    from autopipe.core.request import PlanRequest

    for family in families:
        saved = (profiles or {}).get(family)
        if saved is not None:
            measured = Profile.load(saved)
        else:
            model, inputs = build(family)
            measured = profile(model, inputs, MeasureOptions(warmup=0, repeat=1), progress=False)
        schedule, v = SCHEDULE_OF[family]
        plan = make_plan(
            measured,
            PlanRequest(
                gpus=2, microbatches=4, optimizer="sgd", schedule=schedule, virtual_stages=v
            ),
        )
        assert (plan.schedule, plan.virtual_stages) == (schedule, v)
        plan.save(out / f"{family}.planned.plan.json")
        second_cut(measured, plan).save(out / f"{family}.other.plan.json")


def build(family: str) -> tuple[nn.Module, Any]:
    """(model, example inputs at batch 8) of one family."""
    return globals()[family](), globals()[f"example_inputs_{family}"](8)


def reference_training(
    family: str, lr: float, model: nn.Module | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain model of ``family`` (built here, or ``model``, trained in place) trained 2
    SGD steps (``lr``) on the whole batch with the default objective: its losses and its
    state after (parameters and persistent buffers)."""
    built, inputs = build(family)
    return train_plain(built if model is None else model, inputs, lr)


def train_plain(
    model: nn.Module, inputs: Any, lr: float, steps: int = 2, momentum: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``model`` trained in place ``steps`` SGD steps (``lr``, ``momentum``) on the whole batch
    ``inputs`` with the default objective: its losses and its ``state_dict()`` after."""
    from autopipe.profiler.inputs import call_model
    from autopipe.profiler.objective import default_loss

    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = default_loss(call_model(model, inputs), inputs)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


def load_checkpoint(directory: Any, tmp: Any) -> dict[str, torch.Tensor]:
    """The weights of a ``torch.distributed.checkpoint`` directory (``autopipe run --save``),
    converted through ``tmp``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, tmp / "weights.pt")
    return torch.load(tmp / "weights.pt", weights_only=True)
