import json
import shutil

import pytest
import transformers
from tokenizers import Tokenizer

from gpt2attn.tokenizer import char_tokenizer, encode, load_tokenizer
from tests.helpers import shared_data

TEXTS = ["Hello world", " leading space", "multi  spaces\tand\nnewlines", "émoji 🙂 ünïcödé", "<|endoftext|>after"]


def test_gpt2_tokenizer_matches_transformers():
    folder = shared_data("gpt2-tokenizer")
    ours = load_tokenizer(folder)
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]  # skip the #version line
    hf = transformers.GPT2TokenizerFast(vocab=vocab, merges=[tuple(line.split()) for line in lines if line])
    assert ours.encode("Hello world").ids == hf("Hello world")["input_ids"]
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.token_to_id("<|endoftext|>") == hf.eos_token_id


def test_openai_file_names_and_tokenizer_json(tmp_path):
    folder = shared_data("gpt2-tokenizer")
    shutil.copy(folder / "vocab.json", tmp_path / "encoder.json")
    shutil.copy(folder / "merges.txt", tmp_path / "vocab.bpe")
    openai = load_tokenizer(tmp_path)
    hf_names = load_tokenizer(folder)
    hf_names.save(str(tmp_path / "tokenizer.json"))
    reloaded = load_tokenizer(tmp_path)  # tokenizer.json now takes precedence
    for text in TEXTS:
        assert openai.encode(text).ids == hf_names.encode(text).ids == reloaded.encode(text).ids


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="non-empty"):
        char_tokenizer("")


def test_char_tokenizer_round_trips_and_loads_elsewhere(tmp_path):
    corpus = "First Citizen:\nBefore we proceed any further, hear me speak.\n\tAll:  Speak, speak!"
    tok = char_tokenizer(corpus)
    chars = sorted(set(corpus))
    assert tok.get_vocab_size() == len(chars)
    text = "speak,  hear me\n"
    ids = tok.encode(text).ids
    assert ids == [chars.index(c) for c in text]  # nanoGPT's stoi
    assert tok.decode(ids) == text
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert Tokenizer.from_file(str(path)).encode(text).ids == ids
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert fast(text)["input_ids"] == ids
    assert fast.decode(ids) == text


@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", "2"], ["attention", "--format", "json"]])
def test_commands_name_the_characters_the_shipped_model_cannot_encode(command, capsys):
    from gpt2attn.cli import main

    assert main([*command, "Café 中 🙂"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpt2attn {command[0]}: error: the text has characters")
    assert "'é' (U+00E9), '中' (U+4E2D), '🙂' (U+1F642)" in err
    assert "Traceback" not in err


def test_encode_gives_the_ids_when_every_character_is_known():
    tok = char_tokenizer("abc ")
    assert encode(tok, "cab a") == tok.encode("cab a").ids == [3, 1, 2, 0, 1]


def test_a_char_vocabulary_is_encoded_by_lookup_with_tokenizers_ids(monkeypatch, tmp_path):
    text = "".join(TEXTS) + "\r\n\x00\U0010ffff"  # every kind of character, one past the BMP
    tok = char_tokenizer(text[::-1])  # ids in sorted order, whatever order the text has
    expected = tok.tokenizer.encode(text).ids  # tokenizers' own char-by-char WordLevel
    spec = json.loads(tok.to_str())  # the same characters, ids in reverse order, from a file
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {ch: len(vocab) - 1 - i for ch, i in vocab.items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    reversed_ids = load_tokenizer(tmp_path)
    assert encode(reversed_ids, text) == reversed_ids.tokenizer.encode(text).ids == [len(vocab) - 1 - i for i in expected]
    special = char_tokenizer(text)
    special.add_special_tokens(["<|endoftext|>"])  # added tokens match whole strings: not a lookup
    with_special = special.tokenizer.encode(text).ids
    monkeypatch.setattr(type(tok), "encode", lambda *a, **k: pytest.fail("tokenizers was asked"))
    assert encode(tok, text) == expected
    assert len(expected) == len(text)
    monkeypatch.undo()
    assert encode(special, text) == with_special != expected
    with pytest.raises(ValueError, match=r"does not hold: 'z' \(U\+007A\)"):
        encode(char_tokenizer("abc"), "abz")


def test_a_char_vocabulary_s_own_encode_names_the_missing_character(tmp_path):
    from gpt2attn.shipped import DEFAULT_MODEL_DIR

    shipped = load_tokenizer(DEFAULT_MODEL_DIR)  # the default model's character vocabulary
    for tok in (shipped, char_tokenizer("abc ")):
        with pytest.raises(ValueError, match=r"does not hold: 'é' \(U\+00E9\)"):
            tok.encode("é")
        with pytest.raises(ValueError, match=r"does not hold: 'é' \(U\+00E9\)"):
            tok.encode_batch(["a", "bé"])
        assert tok.decode(tok.encode("a b").ids) == "a b"
    # everything else passes through: settings, saving, loading back
    tok = char_tokenizer("abc ")
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer(tmp_path)
    assert again.get_vocab() == tok.get_vocab() and again.get_vocab_size() == 5
    assert isinstance(load_tokenizer(tmp_path).tokenizer, Tokenizer)
