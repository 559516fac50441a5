"""Every bad input to the model and its config gets an exception that names the problem.

Tables of (case, exception type, message fragment); the inputs that look odd but are fine
(ids of any integer dtype, Python lists, masks that hide a whole row) are checked to give the
same numbers as the plain input.
"""

from __future__ import annotations

import json

import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel, GPT2Model, KVCache
from tests.helpers import max_diff, randomize, tiny_config


@pytest.fixture(scope="module")
def model():
    return randomize(GPT2LMHeadModel(tiny_config()), seed=0).eval()


def ids(*shape, dtype=torch.long):
    return torch.zeros(shape, dtype=dtype)


def cache_of(n_layer=2, n_head=4, head_dim=8, dtype=torch.float32, length=3):
    return tuple((torch.zeros(1, n_head, length, head_dim, dtype=dtype),) * 2 for _ in range(n_layer))


# --- forward ---------------------------------------------------------------------------------

FORWARD_CASES = [
    # token ids
    ("id past the vocabulary", {"input_ids": torch.tensor([[1, 2, 97]])}, ValueError, "input_ids holds 97, outside [0, 97)"),
    ("negative id", {"input_ids": torch.tensor([[1, -1, 2]])}, ValueError, "input_ids holds -1"),
    ("float ids", {"input_ids": ids(1, 3, dtype=torch.float32)}, ValueError, "input_ids must be an integer tensor, got torch.float32"),
    ("bool ids", {"input_ids": ids(1, 3, dtype=torch.bool)}, ValueError, "input_ids must be an integer tensor, got torch.bool"),
    ("1-D ids", {"input_ids": ids(5)}, ValueError, "input_ids must be [batch, seq_len]"),
    ("empty sequence", {"input_ids": ids(1, 0)}, ValueError, "seq_len > 0, got shape (1, 0)"),
    ("ragged list", {"input_ids": [[1, 2, 3], [4]]}, ValueError, "input_ids: a list must be rectangular"),
    ("list of floats", {"input_ids": [[1.5, 2.0]]}, ValueError, "input_ids must be an integer tensor, got torch.float32"),
    ("a string", {"input_ids": "hello"}, TypeError, "input_ids must be a tensor or a list of lists of ints, got str"),
    ("both ids and embeddings", {"input_ids": ids(1, 3), "inputs_embeds": torch.zeros(1, 3, 32)}, ValueError, "exactly one"),
    ("neither ids nor embeddings", {}, ValueError, "exactly one of input_ids and inputs_embeds"),
    # embeddings
    ("embeddings of the wrong width", {"inputs_embeds": torch.zeros(1, 3, 31)}, ValueError, "inputs_embeds must be [batch, seq_len, n_embd=32]"),
    ("embeddings of another dtype", {"inputs_embeds": torch.zeros(1, 3, 32, dtype=torch.float64)}, ValueError,
     "inputs_embeds have dtype torch.float64, the model's weights torch.float32"),
    ("embeddings as a list", {"inputs_embeds": [[[0.0] * 32]]}, TypeError, "inputs_embeds must be a tensor, got list"),
    # positions, token types, lengths
    ("too long", {"input_ids": ids(1, 33)}, ValueError, "n_positions=32"),
    ("position past n_positions", {"input_ids": ids(1, 3), "position_ids": torch.tensor([[0, 1, 32]])}, ValueError, "position_ids holds 32"),
    ("float positions", {"input_ids": ids(1, 3), "position_ids": torch.zeros(1, 3)}, ValueError, "position_ids must be an integer tensor"),
    ("token types of another length", {"input_ids": ids(1, 3), "token_type_ids": ids(1, 4)}, ValueError, "token_type_ids has shape (1, 4)"),
    ("token type past the vocabulary", {"input_ids": ids(1, 3), "token_type_ids": torch.tensor([[0, 0, 200]])}, ValueError, "token_type_ids holds 200"),
    # masks
    ("2-D mask of the wrong length", {"input_ids": ids(1, 5), "attention_mask": torch.ones(1, 4)}, ValueError, "attention_mask has shape (1, 4), expected (1, 5)"),
    ("4-D mask of the wrong shape", {"input_ids": ids(2, 5), "attention_mask": torch.ones(2, 1, 5, 4)}, ValueError, "4-D attention_mask has shape"),
    ("4-D integer mask", {"input_ids": ids(1, 3), "attention_mask": torch.ones(1, 1, 3, 3, dtype=torch.long)}, ValueError,
     "4-D attention_mask must be bool (True = attend) or floating"),
    ("3-D mask", {"input_ids": ids(1, 3), "attention_mask": torch.ones(1, 3, 3)}, ValueError, "attention_mask must be 2-D [batch, seq] or 4-D"),
    ("mask as a list", {"input_ids": ids(1, 3), "attention_mask": [[1, 1, 1]]}, TypeError, "attention_mask must be a tensor, got list"),
    ("head mask of the wrong size", {"input_ids": ids(1, 3), "head_mask": torch.ones(3)}, ValueError, "head_mask has shape (3,)"),
    # labels
    ("labels of another length", {"input_ids": ids(1, 3), "labels": ids(1, 2)}, ValueError, "labels have shape (1, 2)"),
    ("label past the vocabulary", {"input_ids": ids(1, 3), "labels": torch.tensor([[0, 97, 1]])}, ValueError, "labels hold 97"),
    ("float labels", {"input_ids": ids(1, 3), "labels": torch.zeros(1, 3)}, ValueError, "labels must be an integer tensor, got torch.float32"),
    # caches
    ("cache with other heads", {"input_ids": ids(1, 1), "past_key_values": cache_of(n_head=2, head_dim=16)}, ValueError,
     "past_key_values hold 2 heads of size 16, the model has n_head=4 of size 8"),
    ("cache with another head size", {"input_ids": ids(1, 1), "past_key_values": cache_of(head_dim=4)}, ValueError,
     "past_key_values hold 4 heads of size 4"),
    ("cache of another dtype", {"input_ids": ids(1, 1), "past_key_values": cache_of(dtype=torch.float64)}, ValueError,
     "past_key_values have dtype torch.float64, the model's weights torch.float32"),
    ("cache with other layers", {"input_ids": ids(1, 1), "past_key_values": cache_of(n_layer=3)}, ValueError,
     "past_key_values have 3 layers, the model has 2"),
    ("cache of another kind", {"input_ids": ids(1, 1), "past_key_values": "cache"}, ValueError, "past_key_values must be a KVCache"),
    ("cache of another batch", {"input_ids": ids(3, 1), "past_key_values": cache_of()}, ValueError, "batch size 1, input has batch size 3"),
    ("cache overflowing n_positions", {"input_ids": ids(1, 3), "past_key_values": cache_of(length=30)}, ValueError,
     "30 cached + 3 new = 33 positions"),
]


@pytest.mark.parametrize("case, kwargs, error, message", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_bad_forward_input_names_the_problem(model, case, kwargs, error, message):
    with pytest.raises(error) as info:
        model(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8, torch.int8])
def test_ids_of_any_integer_dtype_equal_int64(model, dtype):
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = model(x, labels=x, token_type_ids=x, position_ids=torch.arange(6)[None])
    got = model(x.to(dtype), labels=x.to(dtype), token_type_ids=x.to(dtype), position_ids=torch.arange(6, dtype=dtype)[None])
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)


def test_lists_of_ids_equal_tensors(model):
    rows = [[5, 6, 7, 8], [1, 2, 3, 4]]
    expected = model(torch.tensor(rows), labels=torch.tensor(rows), attention_mask=torch.ones(2, 4, dtype=torch.long))
    got = model(rows, labels=rows, attention_mask=torch.ones(2, 4, dtype=torch.long))
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)


@pytest.mark.parametrize("kind", ["additive -inf", "bool"])
def test_4d_mask_hiding_a_whole_row_is_finite_and_equal_on_both_paths(model, kind):
    """A query that may see nothing sees everything instead, as the 2-D mask path does, on the
    weights path (output_attentions, head_mask) and on the fused SDPA path alike."""
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool)).repeat(2, 1, 1, 1)  # (2, 1, 6, 6)
    allowed[0, 0, 2] = False  # query 2 of row 0 may see no key
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    fused = model(x, attention_mask=mask).logits
    weights = model(x, attention_mask=mask, output_attentions=True)
    head_masked = model(x, attention_mask=mask, head_mask=torch.ones(4)).logits
    assert torch.isfinite(weights.logits).all() and all(torch.isfinite(w).all() for w in weights.attentions)
    assert max_diff(weights.logits, fused) <= 1e-5 and max_diff(head_masked, fused) <= 1e-5
    sees_all = allowed.clone()
    sees_all[0, 0, 2] = True  # what the 2-D path does with such a query
    assert max_diff(model(x, attention_mask=sees_all).logits, fused) <= 1e-5
    row = weights.attentions[0][0, :, 2]  # (nh, 6): a distribution over all six keys
    assert (row > 0).all() and torch.allclose(row.sum(-1), torch.ones(4))


def test_preallocated_cache_of_the_right_shape_is_accepted(model):
    cache = KVCache.preallocate(2, 1, 4, 16, 8)
    assert model(ids(1, 3), past_key_values=cache).logits.shape == (1, 3, 97)
    wrong = KVCache.preallocate(2, 1, 4, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="past_key_values have dtype torch.bfloat16"):
        model(ids(1, 3), past_key_values=wrong)


# --- config ---------------------------------------------------------------------------------

CONFIG_CASES = [
    ("n_inner as a string", {"n_inner": "128"}, ValueError, "GPT2Config.n_inner must be a positive integer or None, got '128'"),
    ("true for an int", {"n_layer": True}, ValueError, "GPT2Config.n_layer must be a positive integer, got True"),
    ("zero vocabulary", {"vocab_size": 0}, ValueError, "GPT2Config.vocab_size must be a positive integer, got 0"),
    ("float width", {"n_embd": 64.0}, ValueError, "GPT2Config.n_embd must be a positive integer, got 64.0"),
    ("width not divisible by heads", {"n_embd": 30, "n_head": 4}, ValueError, "n_embd (30) must be divisible by n_head (4)"),
    ("negative dropout", {"resid_pdrop": -0.1}, ValueError, "GPT2Config.resid_pdrop must be a probability in [0, 1], got -0.1"),
    ("dropout above 1", {"attn_pdrop": 1.5}, ValueError, "GPT2Config.attn_pdrop must be a probability in [0, 1]"),
    ("dropout as a string", {"embd_pdrop": "0.1"}, ValueError, "GPT2Config.embd_pdrop must be a probability"),
    ("negative summary dropout", {"summary_first_dropout": -1}, ValueError, "GPT2Config.summary_first_dropout"),
    ("classifier dropout above 1", {"classifier_dropout": 2.0}, ValueError, "GPT2Config.classifier_dropout must be a probability in [0, 1] or None"),
    ("zero epsilon", {"layer_norm_epsilon": 0.0}, ValueError, "GPT2Config.layer_norm_epsilon must be a positive number, got 0.0"),
    ("negative epsilon", {"layer_norm_epsilon": -1e-5}, ValueError, "GPT2Config.layer_norm_epsilon must be a positive number"),
    ("nan epsilon", {"layer_norm_epsilon": float("nan")}, ValueError, "GPT2Config.layer_norm_epsilon must be a positive number, got nan"),
    ("zero initializer_range", {"initializer_range": 0}, ValueError, "GPT2Config.initializer_range must be a positive number, got 0"),
    ("flag as a string", {"scale_attn_weights": "yes"}, ValueError, "GPT2Config.scale_attn_weights must be true or false, got 'yes'"),
    ("flag as an int", {"use_cache": 1}, ValueError, "GPT2Config.use_cache must be true or false, got 1"),
    ("return_dict as None", {"return_dict": None}, ValueError, "GPT2Config.return_dict must be true or false, got None"),
    ("activation as a number", {"activation_function": 3}, ValueError, "GPT2Config.activation_function must be a string, got 3"),
    ("negative eos", {"eos_token_id": -1}, ValueError, "GPT2Config.eos_token_id must be a token id"),
    ("empty eos list", {"eos_token_id": []}, ValueError, "GPT2Config.eos_token_id must be a token id (an integer >= 0), a non-empty list"),
    ("bos as a string", {"bos_token_id": "0"}, ValueError, "GPT2Config.bos_token_id must be a token id (an integer >= 0) or None, got '0'"),
    ("pad as a float", {"pad_token_id": 1.0}, ValueError, "GPT2Config.pad_token_id must be a token id"),
    ("unknown summary type", {"summary_type": "max"}, ValueError, "GPT2Config.summary_type must be one of last, first, mean, cls_index, attn, got 'max'"),
    ("unknown problem type", {"problem_type": "multi"}, ValueError, "GPT2Config.problem_type must be None or one of regression"),
    ("label ids that are not numbers", {"id2label": {"a": "x"}}, ValueError, "GPT2Config.id2label keys must be integer ids, got ['a']"),
    ("labels as a list", {"id2label": ["x", "y"]}, ValueError, "GPT2Config.id2label must be a non-empty dict"),
    ("label2id not a dict", {"label2id": ["x"]}, ValueError, "GPT2Config.label2id must be a dict of {label name: id}"),
    ("zero labels", {"num_labels": 0}, ValueError, "GPT2Config.num_labels must be a positive integer, got 0"),
    ("num_labels against id2label", {"num_labels": 3, "id2label": {0: "a", 1: "b"}}, ValueError, "num_labels=3 disagrees with id2label, which has 2 labels"),
    ("architectures as a string", {"architectures": "GPT2LMHeadModel"}, ValueError, "GPT2Config.architectures must be a list of class names or None"),
    ("another model type", {"model_type": "bert"}, ValueError, "config has model_type 'bert'"),
    ("a computed property", {"head_dim": 8}, ValueError, "'head_dim' cannot be set: it is computed or a method"),
    ("a method's name", {"to_dict": 1}, ValueError, "'to_dict' cannot be set"),
]


@pytest.mark.parametrize("case, kwargs, error, message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_names_the_field(tmp_path, case, kwargs, error, message):
    with pytest.raises(error) as info:
        GPT2Config(**kwargs)
    assert message in str(info.value)
    if all(isinstance(v, (str, int, float, list, dict)) and v == v for v in kwargs.values()):  # JSON can hold it
        path = tmp_path / "config.json"
        path.write_text(json.dumps(kwargs))
        with pytest.raises(error) as info:  # read from a file, the message names the file too
            GPT2Config.from_json_file(path)
        assert str(path) in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [("[1, 2]", "a config must be a JSON object (a dict of fields), got list"),
     ('"gpt2"', "a config must be a JSON object (a dict of fields), got str"),
     ("{not json", "not valid JSON")],
)
def test_config_file_that_is_not_an_object(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        GPT2Config.from_json_file(path)
    assert str(path) in str(info.value) and message in str(info.value)
    with pytest.raises(ValueError, match="must be a JSON object"):
        GPT2Config.from_dict([1, 2])


def test_config_changed_after_construction_is_checked_by_the_model():
    config = tiny_config()
    config.layer_norm_epsilon = 0.0  # would make every logit NaN
    with pytest.raises(ValueError, match="GPT2Config.layer_norm_epsilon must be a positive number, got 0.0"):
        GPT2LMHeadModel(config)
    with pytest.raises(TypeError, match="dict is not a GPT-2 config: it has no vocab_size, n_positions, n_embd"):
        GPT2Model({"n_layer": 2})


@pytest.mark.parametrize(
    "kwargs, message",
    [({"pruned_heads": {"0": [1]}}, "pruned_heads=.*not supported"),
     ({"activation_function": "gelu_nope"}, "unknown activation_function 'gelu_nope'")],
)
def test_architecture_the_model_cannot_build_is_refused(kwargs, message):
    config = tiny_config(**kwargs)  # valid as a config (transformers takes it) ...
    with pytest.raises(ValueError, match=message):  # ... but not built silently without it
        GPT2LMHeadModel(config)
