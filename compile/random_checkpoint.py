"""Randomly initialised Llama checkpoints in Hugging Face format, with a working tokenizer.

They stand in for a real model where none is at hand (`--model random:<preset>`, tests, benchmarks):
the weights are random, so the text they generate is noise, but every shape, file and code path is the
real one. The tokenizer is a byte-fallback BPE (3 specials, 256 byte tokens, printable characters and
deterministic merges up to the model's vocabulary), so any text round-trips and every id decodes.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from app.errors import ConfigError

RANDOM_PREFIX = "random:"
SPECIALS = ("<unk>", "<s>", "</s>")
SPACE = "\u2581"  # SentencePiece's word boundary marker, "▁"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}### {{ message['role'] }}:\n"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    # About 100M parameters: Llama-shaped (GQA 3:1, head_dim 64), fewer layers than a real 1B model.
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    # About 1.1B parameters: Llama-3.2-1B's shape with a 32000-token vocabulary (model_bench's weights).
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}


def is_random_source(source: str) -> bool:
    return source.startswith(RANDOM_PREFIX)


def preset_from_source(source: str) -> str:
    """`random:tiny` -> `tiny`, checked against the known presets."""
    return check_preset(source.removeprefix(RANDOM_PREFIX))


def check_preset(preset: str) -> str:
    if preset not in PRESETS:
        raise ConfigError(f"unknown random model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return preset


def write_random_llama(out_dir: Path, preset: str = "tiny", *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random Llama checkpoint (config, generation config, safetensors, tokenizer) to `out_dir`.

    `overrides` replace preset config fields (e.g. `num_hidden_layers=1`). Same preset, seed and
    overrides give byte-identical weights. Returns `out_dir`.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    fields = {**PRESETS[check_preset(preset)], **overrides}
    config = LlamaConfig(
        **fields, bos_token_id=1, eos_token_id=2, pad_token_id=None, rms_norm_eps=1e-5, rope_theta=10000.0
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=[2]).save_pretrained(out_dir)
    write_tokenizer(out_dir, config.vocab_size, config.max_position_embeddings)
    _write_readme(out_dir, preset, seed, fields)
    return out_dir


def write_tokenizer(out_dir: Path, vocab_size: int, max_length: int) -> None:
    """Save a byte-fallback BPE tokenizer of exactly `vocab_size` tokens with a chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _bpe_vocab(vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    # Every space becomes "▁" and one "▁" is prepended, so leading and repeated spaces survive a round trip.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    tokenizer.decoder = decoders.Sequence(  # Llama's own decoder: restore spaces, drop the prepended one
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    # The chat template goes into tokenizer_config.json, which every transformers version reads.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _bpe_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials, the 256 byte tokens, printable characters, then merges (pairs, then longer) to fill."""
    symbols = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    chars = [SPACE, *(c for c in string.printable if c not in string.whitespace)]
    symbols += chars
    if vocab_size < len(symbols):
        raise ConfigError(f"random tokenizer needs a vocabulary of at least {len(symbols)}, got {vocab_size}")
    merges: list[tuple[str, str]] = []
    pieces = chars
    while len(symbols) < vocab_size:
        longer = [piece + char for piece in pieces for char in chars[1:]]
        for piece in longer[: vocab_size - len(symbols)]:
            merges.append((piece[:-1], piece[-1]))
            symbols.append(piece)
        pieces = longer
    return {symbol: index for index, symbol in enumerate(symbols)}, merges


def _write_readme(out_dir: Path, preset: str, seed: int, fields: dict[str, Any]) -> None:
    text = (
        f"# Random Llama ({preset}, seed {seed})\n\n"
        "The weights in this checkpoint are RANDOMLY INITIALISED (inf2serve compile/random_checkpoint.py):\n"
        "it exercises every shape and code path of a real Llama, but its output is noise.\n\n"
        f"```json\n{json.dumps(fields, indent=2, sort_keys=True)}\n```\n"
    )
    (out_dir / "README.md").write_text(text)
