"""Batch: row operations keep tensors and metadata aligned; bad shapes fail; transport compacts views."""

import pickle

import numpy as np
import pytest
import torch

from meshrl.protocol import Batch


def make(n=6):
    return Batch(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": [f"p{i // 2}" for i in range(n)], "gt": [{"answer": i} for i in range(n)]},
        meta={"step": 7},
    )


def test_take_reorder_keep_rows_aligned():
    b = make()
    perm = [5, 0, 3, 1, 4, 2]
    r = b.reorder(perm)
    assert r["score"].tolist() == [float(p) for p in perm]
    assert [g["answer"] for g in r["gt"]] == perm
    inverse = np.argsort(perm)
    assert torch.equal(r.reorder(inverse)["ids"], b["ids"])
    assert r.meta == {"step": 7}


def test_reorder_refuses_non_permutation():
    with pytest.raises(ValueError, match="permutation"):
        make().reorder([0, 0, 1, 2, 3, 4])


def test_split_chunk_concat_roundtrip():
    b = make()
    parts = b.split([1, 3, 2])
    assert [len(p) for p in parts] == [1, 3, 2]
    assert torch.equal(Batch.concat(parts)["ids"], b["ids"])
    assert list(Batch.concat(parts)["uid"]) == list(b["uid"])
    assert [len(p) for p in b.split(4)] == [4, 2]
    assert [len(p) for p in b.chunk(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="equal pieces"):
        b.chunk(4)
    with pytest.raises(ValueError, match="sum to"):
        b.split([1, 1])


def test_repeat_interleave_for_n_samples():
    b = make(2).repeat_interleave(3)
    assert b["score"].tolist() == [0, 0, 0, 1, 1, 1]
    assert list(b["uid"]) == ["p0"] * 6


def test_token_id_lists_stay_ragged_objects():
    b = Batch(non_tensors={"prompt_ids": [[1, 2], [3, 4]]})
    assert b["prompt_ids"].dtype == object and b["prompt_ids"][1] == [3, 4]


def test_mismatched_sizes_fail():
    with pytest.raises(ValueError, match="disagree"):
        Batch(tensors={"a": torch.zeros(3)}, non_tensors={"b": [1, 2]})
    b = make()
    with pytest.raises(ValueError, match="rows"):
        b.set("x", torch.zeros(2))
    with pytest.raises(KeyError, match="no field"):
        b["nope"]


def test_concat_requires_same_fields():
    with pytest.raises(ValueError, match="fields"):
        Batch.concat([make(2), make(2).select(["ids"])])


def test_union_and_select():
    b = make()
    extra = Batch(tensors={"adv": torch.ones(6)})
    u = b.union(extra)
    assert set(u.keys()) == {"ids", "score", "uid", "gt", "adv"}
    assert set(u.select(["adv", "uid"]).keys()) == {"adv", "uid"}
    with pytest.raises(ValueError, match="differs"):
        b.union(Batch(tensors={"score": torch.zeros(6)}))


def test_pickle_compacts_slice_views():
    big = Batch(tensors={"x": torch.zeros(1000, 256)})
    piece = big.split(10)[0]
    blob = pickle.dumps(piece)
    assert len(blob) < 10 * 256 * 4 * 2  # not the whole 1 MB storage
    assert torch.equal(pickle.loads(blob)["x"], piece["x"])


def test_a_batch_in_plain_form_loads_back_with_weights_only(tmp_path):
    """``Batch.plain`` is what an asynchronous checkpoint holds of a queued sample: ``torch.load(weights_only=True)``
    reads it back, and ``from_plain`` gives the batch again (tensors, numeric columns with their dtype, object columns,
    meta); a row view is saved as its own rows, not the storage it views."""
    full = Batch({"responses": torch.arange(12).reshape(6, 2), "mask": torch.ones(6, 2)},
                 {"prompt_ids": [[1, 2], [3], [4, 5, 6], [7], [8], [9]], "score": np.arange(6, dtype=np.float32),
                  "raw_prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(6)]}, {"temperature": 1.0})
    batch = full.take([2, 3])
    torch.save(batch.plain(), tmp_path / "state.pt")
    back = Batch.from_plain(torch.load(tmp_path / "state.pt", weights_only=True))
    assert back.keys() == batch.keys() and back.meta == batch.meta
    assert torch.equal(back["responses"], batch["responses"]) and back["score"].dtype == np.float32
    assert list(back["prompt_ids"]) == [[4, 5, 6], [7]] and back["raw_prompt"][1][0]["content"] == "q3"
    assert batch.plain()["tensors"]["responses"].untyped_storage().nbytes() == 2 * 2 * 8
