"""KVStorage: chained prefix keys, atomic files, checks on load, retirement."""

from __future__ import annotations

import glob
import os
import shutil

import torch

from hotswap.engine.kvcache.storage import KVStorage, weights_fingerprint

NS = '{"weight_version": "0"}'


def block(seed: int, tokens: int = 4) -> torch.Tensor:
    return torch.randn(6, tokens, 2, 8, generator=torch.Generator().manual_seed(seed))


def test_block_keys_name_the_whole_prefix(tmp_path):
    st = KVStorage(str(tmp_path), block_tokens=4)
    a = st.block_hashes(NS, list(range(10)))
    assert len(a) == 2  # whole blocks only
    assert st.block_hashes(NS, list(range(8))) == a
    # Equal second blocks behind different first blocks are different keys.
    b = st.block_hashes(NS, [99, 1, 2, 3, 4, 5, 6, 7])
    assert b[0] != a[0] and b[1] != a[1]
    assert st.block_hashes('{"weight_version": "1"}', list(range(8)))[0] != a[0]


def test_save_then_load_round_trips_and_checks_what_it_reads(tmp_path):
    st = KVStorage(str(tmp_path), block_tokens=4)
    tokens = [5, 6, 7, 8]
    key = st.block_hashes(NS, tokens)[0]
    kv = block(0)
    assert st.save(NS, key, tokens, kv)
    assert torch.equal(st.load(NS, key, tokens), kv)
    assert st.load(NS, key, [5, 6, 7, 9]) is None  # tokens differ: a hash collision is a miss
    assert not glob.glob(f"{tmp_path}/**/*.tmp", recursive=True)
    # A file copied into another namespace's folder names its own namespace: refused there.
    other = '{"weight_version": "1"}'
    os.makedirs(os.path.dirname(st._path(other, key)), exist_ok=True)
    shutil.copy(st._path(NS, key), st._path(other, key))
    assert st.load(other, key, tokens) is None


def test_damaged_or_missing_files_are_misses(tmp_path):
    st = KVStorage(str(tmp_path), block_tokens=4)
    tokens = [1, 2, 3, 4]
    key = st.block_hashes(NS, tokens)[0]
    assert st.load(NS, key, tokens) is None
    st.save(NS, key, tokens, block(1))
    path = st._path(NS, key)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert st.load(NS, key, tokens) is None


def test_retire_deletes_one_namespace(tmp_path):
    st = KVStorage(str(tmp_path), block_tokens=4)
    other = '{"weight_version": "1"}'
    tokens = [1, 2, 3, 4]
    for ns in (NS, other):
        st.save(ns, st.block_hashes(ns, tokens)[0], tokens, block(2))
    st.retire(NS)
    assert st.load(NS, st.block_hashes(NS, tokens)[0], tokens) is None
    assert st.load(other, st.block_hashes(other, tokens)[0], tokens) is not None
    assert len(os.listdir(tmp_path)) == 1
    st.retire(NS)  # retiring twice is harmless


def test_weights_fingerprint_follows_the_values():
    torch.manual_seed(0)
    weights = [torch.randn(300, 64), torch.randn(64)]
    same = [w.clone() for w in weights]
    stepped = [w + 1e-3 * torch.randn_like(w) for w in weights]
    assert weights_fingerprint(weights) == weights_fingerprint(same)
    assert weights_fingerprint(weights) != weights_fingerprint(stepped)
