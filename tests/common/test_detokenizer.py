"""Incremental detokenization: the text put out so far is always a prefix of decoding every token again, and
all of it equals that decode at the end — on the default checkpoint's byte-level BPE and on a Llama-style
tokenizer (SentencePiece metaspace, byte fallback, the leading space stripped)."""

import json
import random

import pytest

from common.detokenizer import IncrementalDetokenizer


def _llama_style():
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    rng = random.Random(0)
    words = ["the", "kitchen", "naïve", "café", "über", "日本語", "smile 😀", "a", "tiny", "model", "."]
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(300)]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    spec = json.loads(tok.to_str())  # byte pieces in the model's own vocabulary, as Llama's has them
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


def _tiny_decode(tiny_dir):
    from common.model.processor import ChatProcessor

    processor = ChatProcessor(tiny_dir)
    return processor.detokenize, len(processor.tokenizer)


def _random_ids(which: str, rng: random.Random, tok, vocab: int) -> list[int]:
    """Any ids for the byte-level tokenizer; for the Llama-style one, encoded text (characters outside its
    vocabulary come out as byte pieces): its byte fallback renders a run of byte pieces that is not valid
    UTF-8 as U+FFFD for every byte, so a prefix cut mid-character decodes differently from the whole."""
    if which == "tiny":
        return [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
    alphabet = ["the", " ", "kitchen", "é", "日本", "語", "😀", "ß", "Ω", ".", "\n", "ok", "ǅ", "🙂🙃"]
    return tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 120)))).ids


@pytest.mark.parametrize("which", ["tiny", "llama-style"])
def test_the_text_put_out_is_always_the_whole_decode(which, tiny_dir):
    tok = None
    if which == "tiny":
        decode, vocab = _tiny_decode(tiny_dir)
    else:
        tok = _llama_style()
        decode, vocab = (lambda ids: tok.decode(ids, skip_special_tokens=True)), tok.get_vocab_size(True)
    held = 0
    for seed in range(30):
        rng = random.Random(seed)
        ids = _random_ids(which, rng, tok, vocab)
        detok, out, i = IncrementalDetokenizer(decode), "", 0
        whole = decode(ids)
        while i < len(ids):
            step = rng.choice([1, 1, 1, 2, 5])
            out += detok.push(ids[i : i + step])
            i += step
            assert whole.startswith(out), (seed, i)
            held += len(decode(ids[:i])) - len(out)
        out += detok.finish()
        assert out == whole == detok.text, seed
    assert held > 0  # some steps did hold back an incomplete character


def test_a_character_split_over_byte_pieces_is_held_until_complete():
    tok = _llama_style()
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True))
    first, second = tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")  # "é" in UTF-8
    word = tok.encode("kitchen").ids
    assert detok.push(word) == "kitchen"  # the leading space of a first piece is stripped, as decode does
    assert detok.push([first]) == ""
    assert detok.push([second]) == "é"
    assert detok.push(word) == " kitchen"
    assert detok.finish() == "" and detok.text == "kitchené kitchen"


def test_an_incomplete_character_at_the_end_comes_out_as_a_replacement():
    tok = _llama_style()
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True))
    omega = [tok.token_to_id("<0xCE>"), tok.token_to_id("<0xA9>")]
    assert detok.push(omega) == "Ω"
    assert detok.push([tok.token_to_id("<0xC3>")]) == ""  # the start of "é", cut off by max_tokens
    assert detok.finish() == "�" and detok.text == "Ω�"  # the whole decode would say "���"
