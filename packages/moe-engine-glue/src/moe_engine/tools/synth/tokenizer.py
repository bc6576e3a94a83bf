"""A small valid byte-level BPE tokenizer, padded to the model's vocabulary size, for synthetic checkpoints.

llama.cpp needs `tokenizer.ggml.*` keys to load a GGUF file (`tokenizer.ggml.model` is read unconditionally; its
"no_vocab" mode loads without tokens, but then nothing tokenizes text), and `moe-engine generate --prompt` needs a
tokenizer. So every file gets the smallest real one: GPT-2's 256 byte tokens, 170 merges (a space before each
letter, pairs of the 12 most frequent English letters), the chat specials, and reserved tokens up to the
vocabulary size (tokens no merge produces, type UNUSED in GGUF). GGUF: `tokenizer.ggml.model` "gpt2", `pre`
"qwen2" (the pre-tokenizer regex of Qwen's files). Hugging Face directories: the same vocabulary as tokenizer.json."""
from __future__ import annotations

import json
from dataclasses import dataclass

LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NORMAL, CONTROL, UNUSED = 1, 3, 5  # gguf.TokenType


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


@dataclass(frozen=True)
class Vocab:
    """tokens (id order), GGUF token types, merges ("a b"), and the special ids. Immutable; shareable."""

    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int

    @property
    def specials(self) -> dict[str, int]:
        return {t: i for i, (t, k) in enumerate(zip(self.tokens, self.types)) if k == CONTROL}


def byte_level_bpe(vocab_size: int) -> Vocab:
    byte_tok = _bytes_to_unicode()
    space = byte_tok[ord(" ")]
    pairs = [(space, c) for c in LETTERS] + [(a, b) for a in LETTERS[:12] for b in LETTERS[:12]]
    tokens = byte_tok + [a + b for a, b in pairs] + list(SPECIALS)
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size={vocab_size}: the tokenizer needs at least {len(tokens)}")
    types = [NORMAL] * (len(tokens) - len(SPECIALS)) + [CONTROL] * len(SPECIALS)
    n = vocab_size - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(n)]
    types += [UNUSED] * n
    first = len(tokens) - n - len(SPECIALS)
    return Vocab(tuple(tokens), tuple(types), tuple(f"{a} {b}" for a, b in pairs), bos_id=first, eos_id=first,
                 pad_id=first)


def add_to_gguf(writer, v: Vocab, pre: str = "qwen2") -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(v.tokens))
    writer.add_token_types(list(v.types))
    writer.add_token_merges(list(v.merges))
    writer.add_bos_token_id(v.bos_id)
    writer.add_eos_token_id(v.eos_id)
    writer.add_pad_token_id(v.pad_id)
    writer.add_add_bos_token(False)


def tokenizer_json(v: Vocab) -> str:
    """The Hugging Face `tokenizers` file of the same vocabulary (byte-level pre-tokenizer and decoder, BPE)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for t, i in v.specials.items()]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {t: i for i, t in enumerate(v.tokens)}, "merges": [m.split(" ") for m in v.merges]}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                       "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
                       "decoder": byte_level, "model": model}, ensure_ascii=False)


def tokenizer_config(v: Vocab) -> dict:
    eos = v.tokens[v.eos_id]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos, "pad_token": eos,
            "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
