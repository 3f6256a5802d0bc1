"""The bundled tokenizer: a small whitespace word-level vocabulary, shipped as tokenizer.json in the package.

``scripts/make_tokenizer.py`` writes the file from :func:`build_tokenizer`; a test checks that the shipped file and the
builder agree, so the asset can never drift from its source.
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_PATH = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
WORDS = [str(d) for d in range(10)] + ["repeat", "copy", "reverse", "sort", "=", "+", "-", "?", ":", ","]


def build_tokenizer():
    """The tokenizers.Tokenizer behind the bundled vocabulary (specials first: pad 0, bos 1, eos 2, unk 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return tok


def load_bundled_tokenizer():
    """The bundled tokenizer as a transformers fast tokenizer (pad, bos, eos set; left padding for generation)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_PATH),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
