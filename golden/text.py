"""Text in, text out: a model's tokenizer (a Hugging Face ``tokenizers`` JSON file), or UTF-8 bytes
for byte-level models (lockstep's own, vocab 256: token id = byte value)."""

from __future__ import annotations

from pathlib import Path

from lockstep.errors import LockstepError

__all__ = ["Text", "TokenizerError"]


class TokenizerError(LockstepError, ValueError):
    """A tokenizer cannot be loaded or does not fit the model."""


class Text:
    def __init__(self, tokenizer=None, name: str = "bytes", vocab: int | None = None):
        self.tokenizer = tokenizer
        self.name = name
        self.vocab = vocab  # the model's: an id at or above it is refused at encode

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
            # added (special) tokens past the embedding table are what transformers 5 writes for a Qwen2
            # tokenizer without its <|endoftext|> (GenAI's builder saves it so): usable while a prompt never
            # produces one; a regular token past it means another model's tokenizer
            added = {t.content for t in tok.get_added_tokens_decoder().values()}
            beyond = sorted((i, t) for t, i in tok.get_vocab(with_added_tokens=True).items() if i >= vocab)
            regular = [t for _, t in beyond if t not in added]
            if regular:
                raise TokenizerError(f"tokenizer {path} has {tok.get_vocab_size()} tokens, more than the model's "
                                     f"{vocab} (ids {beyond[0][0]}..{beyond[-1][0]}, e.g. {regular[0]!r}): not this "
                                     "model's tokenizer")
        return cls(tok, str(path), vocab)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        # the tokenizer's own post-processor applies (a BOS the exporter's tokenizer.json prepends), as
        # transformers' tokenizer(text) does: the prompt the model was exported to see
        ids = list(self.tokenizer.encode(text, add_special_tokens=True).ids)
        over = [i for i in ids if self.vocab is not None and i >= self.vocab]
        if over:
            raise TokenizerError(f"tokenizer {self.name}: {text[:40]!r} encodes to id {over[0]}, outside the model's "
                                 f"vocabulary of {self.vocab} (an added token past its embedding table)")
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
