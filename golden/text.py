"""Text in, text out: a model's tokenizer (a Hugging Face ``tokenizers`` JSON file), or UTF-8 bytes
for byte-level models (lockstep's own, vocab 256: token id = byte value)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["Text", "TokenizerError"]


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or does not fit the model."""


class Text:
    def __init__(self, tokenizer=None, name: str = "bytes"):
        self.tokenizer = tokenizer
        self.name = name

    @classmethod
    def load(cls, path: str | Path | None, vocab: int) -> "Text":
        """The tokenizer at ``path``, or bytes when none is given (the model's vocab must hold them)."""
        if path is None:
            if vocab < 256:
                raise TokenizerError(f"the model's vocabulary has {vocab} tokens: not byte-level; give its "
                                     "tokenizer (--tokenizer tokenizer.json)")
            return cls()
        path = Path(path)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"reading {path} needs the `tokenizers` package: "
                                 "pip install 'lockstep-conformance[models]'") from None
        if not path.is_file():
            raise TokenizerError(f"tokenizer {path}: no such file")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise TokenizerError(f"tokenizer {path}: not a tokenizers JSON file ({exc})") from None
        if tok.get_vocab_size() > vocab:
            raise TokenizerError(f"tokenizer {path} has {tok.get_vocab_size()} tokens, more than the model's {vocab}")
        return cls(tok, str(path))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        # the tokenizer's own post-processor applies (a BOS the exporter's tokenizer.json prepends), as
        # transformers' tokenizer(text) does: the prompt the model was exported to see
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
